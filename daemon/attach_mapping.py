"""How an Attach reply and its slab fds become tensors: the slabs mapped (into a new mapping,
or at the addresses of an unmapped one), the tensor table validated, one view per tensor.

`Client.attach` imports this module only once the daemon has answered (its imports — memory
backends, tensor table, torch under them — overlap the first Attach RPC), so `resident
preload status` and other light clients never load it.
"""
from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any

from resident.daemon.errors import DaemonError
from resident.daemon.memory import SlabDesc, backend_class
from resident.daemon.memory.base import SlabMapping
from resident.daemon.tensor_table import TensorTable, crc32_of
from resident.protos.resident.v1 import weight_cache_pb2 as pb


def map_slabs(slabs: Sequence[pb.SlabInfo], fds: dict[int, int], into: SlabMapping | None) -> SlabMapping:
    """Map the `slabs` an Attach reply describes from their `fds` (closed here, mapped or not);
    with `into` (an unmapped mapping of the same slabs), at that mapping's addresses."""
    descs = [SlabDesc(index=info.index, nbytes=info.nbytes, backend=info.backend, device=info.device,
                      device_uuid=info.device_uuid, ipc_handle=bytes(info.ipc_handle))
             for info in sorted(slabs, key=lambda s: s.index)]
    try:
        if len({d.backend for d in descs}) != 1:
            raise DaemonError(f"the daemon described slabs of backends {sorted({d.backend for d in descs})}")
        if into is not None:
            into.remap(descs, [fds.get(d.index) for d in descs])
            return into
        return backend_class(descs[0].backend).map_slabs(descs, [fds.get(d.index) for d in descs])
    finally:
        for fd in fds.values():
            os.close(fd)


def tensor_views(reply: pb.AttachResponse, slabs: list[Any],
                 verify_checksums: bool) -> tuple[TensorTable, dict[str, Any]]:
    """The reply's tensor table, validated against the mapped `slabs`, and one view per tensor;
    with `verify_checksums`, every tensor that has a CRC32 is checked against it."""
    if [s.index for s in sorted(reply.slabs, key=lambda s: s.index)] != list(range(len(slabs))):
        raise DaemonError("the daemon described slabs with non-contiguous indices")
    table = TensorTable.from_proto(reply.tensors)
    tensors = table.views(slabs)
    if verify_checksums:
        for entry in reply.tensors:
            if entry.crc32 and crc32_of(tensors[entry.name]) != entry.crc32:
                raise DaemonError(f"tensor {entry.name}: checksum mismatch (memory corrupted?)")
    return table, tensors
