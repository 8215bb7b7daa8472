"""The agreement check before every collective: do all ranks make the same call, and what if they do not."""
