"""Transports: the contract every transport implements, the table that picks them, and the transports."""
