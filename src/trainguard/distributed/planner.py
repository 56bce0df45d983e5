"""Planners: DCP's default planning (sharding, dedup of replicated tensors across ranks) with our value codec
in place of DCP's pickle for non-tensor entries.

The state handed to DCP is already flat (``{fqn: leaf}``, see :mod:`trainguard.state.flatten`), so both
planners run with ``flatten_state_dict=False``, and with ``flatten_sharded_tensors=False`` (DCP rebuilds
nested values with str keys there, turning ``{1: "a"}`` into ``{"1": "a"}``; it only serves legacy FSDP1 2D
ShardedTensors, not DTensor/FSDP2).
"""

from __future__ import annotations

import io
from typing import Any

from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner, DefaultSavePlanner
from torch.distributed.checkpoint.planner import ReadItem, WriteItem, WriteItemType

from ..state.values import EncodedValue, decode_value, encode_value


class TrainguardSavePlanner(DefaultSavePlanner):
    """DefaultSavePlanner whose BYTE_IO items are encoded by :func:`trainguard.state.values.encode_value`."""

    def __init__(self) -> None:
        super().__init__(flatten_state_dict=False, flatten_sharded_tensors=False)

    def transform_object(self, write_item: WriteItem, object: Any) -> Any:  # noqa: A002 - DCP's name
        if write_item.type == WriteItemType.BYTE_IO:
            if isinstance(object, EncodedValue):
                return io.BytesIO(object.payload)
            return io.BytesIO(encode_value(object, write_item.index.fqn))
        return object


class TrainguardLoadPlanner(DefaultLoadPlanner):
    """DefaultLoadPlanner that decodes values with :func:`trainguard.state.values.decode_value` (JSON or
    ``torch.load(weights_only=True)``), never ``weights_only=False``."""

    def __init__(self) -> None:
        super().__init__(flatten_state_dict=False, flatten_sharded_tensors=False, allow_partial_load=False)

    def load_bytes(self, read_item: ReadItem, value: io.BytesIO) -> None:
        fqn = read_item.dest_index.fqn
        decoded = decode_value(value.getvalue(), fqn)
        # set_up_planner may have replaced self.state_dict by a copy (sharded-tensor flattening): the caller's
        # dict is original_state_dict.
        self.state_dict[fqn] = decoded
        self.original_state_dict[fqn] = decoded
