"""Pure-PyTorch references (masked dense): ground truth for tests, CPU path, autograd path.

The group masking semantics are the core's (``compresskit.routing.mask_input_groups``): every
fast kernel here must reproduce them.
"""

from __future__ import annotations

from compresskit.routing import mask_input_groups as torch_group_masked_input

__all__ = ["torch_group_masked_input"]
