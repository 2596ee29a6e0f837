"""Where a graph node came from in the user's code, for messages that name their source line."""
from __future__ import annotations

import re

import torch.fx as fx

_FRAME = re.compile(r'File "([^"]+)", line (\d+), in (\S+)')


_IN_TORCH = re.compile(r"/site-packages/torch/|/torch/(nn|_dynamo|_ops|_tensor|functional)")


def node_site(node: fx.Node | None) -> str:
    """Short source location of ``node``: ``"hstu.py:30 in forward"`` from the innermost frame of
    ``node.meta["stack_trace"]`` outside torch itself (the user's line, as Dynamo recorded it; a
    traced ``F.rms_norm`` would otherwise point into torch/nn/functional.py), else the node name."""
    if node is None:
        return "<graph>"
    frames = _FRAME.findall(node.meta.get("stack_trace") or "")
    if not frames:
        return node.name
    user = [f for f in frames if not _IN_TORCH.search(f[0].replace(chr(92), "/"))]
    filename, line, fn = (user or frames)[-1]
    return f"{filename.replace(chr(92), '/').rsplit('/', 1)[-1]}:{line} in {fn}"


__all__ = ["node_site"]
