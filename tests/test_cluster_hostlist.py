"""Slurm hostlist and tasks-per-node expansion (TensorFlow's cases and more)."""

import pytest

from mpistrat.cluster.hostlist import expand_hostlist, expand_tasks_per_node


@pytest.mark.parametrize("text, hosts", [
    ("n1", ["n1"]),
    ("n[1,3]", ["n1", "n3"]),
    ("n[1-3]", ["n1", "n2", "n3"]),
    ("n[1-2],m5,o[3-4,6,7-9]", ["n1", "n2", "m5", "o3", "o4", "o6", "o7", "o8", "o9"]),
    ("n[0001-0003],m5,o[009-011]", ["n0001", "n0002", "n0003", "m5", "o009", "o010", "o011"]),
    ("n[8-11]", ["n8", "n9", "n10", "n11"]),
    ("r[1-2]n[01-02]", ["r1n01", "r1n02", "r2n01", "r2n02"]),
    ("gpu[1-2]-ib,login", ["gpu1-ib", "gpu2-ib", "login"]),  # suffix: python-hostlist's reading
    ("n[001-3]", ["n001", "n002", "n003"]),  # width of the first bound, as Slurm
    ("n[1-010]", [f"n{i}" for i in range(1, 11)]),
    ("n[3,1-2]", ["n3", "n1", "n2"]),
    ("t02n13,t02n41,t02n43", ["t02n13", "t02n41", "t02n43"]),
    ("b,a,b", ["b", "a", "b"]),  # order and duplicates kept
    ("node.example.org", ["node.example.org"]),
])
def test_expand_hostlist(text, hosts):
    assert expand_hostlist(text) == hosts


@pytest.mark.parametrize("text, why", [
    ("", "empty"),
    ("n[1-3", "never closed"),
    ("n1-3]", "without"),
    ("n[[1]]", "nested"),
    ("n[]", "empty brackets"),
    ("n[3-1]", "backwards"),
    ("n[a-b]", "bad range"),
    ("n1,,n2", "empty entry"),
])
def test_expand_hostlist_errors_name_the_input(text, why):
    with pytest.raises(ValueError, match="Invalid hostlist") as info:
        expand_hostlist(text)
    assert why in str(info.value)
    assert repr(text) in str(info.value)


def test_expand_hostlist_type_error():
    with pytest.raises(TypeError, match="string"):
        expand_hostlist(["n1"])


@pytest.mark.parametrize("text, counts", [
    ("2", [2]),
    ("2,1,3", [2, 1, 3]),
    ("3(x2),2,1", [3, 3, 2, 1]),
    ("3(x2),2,11(x4)", [3, 3, 2, 11, 11, 11, 11]),
    ("13(x10)", [13] * 10),
])
def test_expand_tasks_per_node(text, counts):
    assert expand_tasks_per_node(text) == counts


@pytest.mark.parametrize("text", ["", "2(x)", "x2", "2(2)", "1,,2", "-1"])
def test_expand_tasks_per_node_errors(text):
    with pytest.raises(ValueError, match="Invalid tasks-per-node list"):
        expand_tasks_per_node(text)
