"""QueryChannel: the guard's counted side channel, drained exactly at close."""

import numpy as np
import pytest
from mpi4py import MPI

from mpistrat.comm.agreement.query_channel import QueryChannel


@pytest.mark.mpi(min_size=2)
@pytest.mark.timeout(30)
def test_drain_receives_every_message_sent_and_not_read(comm):
    ctl = comm.Dup()
    channel = QueryChannel(comm)
    try:
        for dest in range(comm.size):  # rank r sends r + 1 messages to every other rank, unprobed
            if dest != comm.rank:
                for i in range(comm.rank + 1):
                    channel.post(("note", comm.rank, i), dest, 7)
        status = MPI.Status()
        msg = channel.probe(7, status) if comm.rank == 0 else None  # maybe one read before the drain
        if msg is not None:
            assert channel.take(msg, status)[0] == "note"
        channel.drain(ctl, 1.0)
        expected = [0 if r == comm.rank else r + 1 for r in range(comm.size)]
        assert channel._received_from.tolist() == expected
        assert not channel.comm.iprobe(MPI.ANY_SOURCE, MPI.ANY_TAG), "nothing may be left behind"
        assert np.array_equal(channel._sent_to, [0 if d == comm.rank else comm.rank + 1 for d in range(comm.size)])
    finally:
        channel.free()
        ctl.Free()
