"""Host-side tensor copies that avoid torch's intra-op thread pool where it costs more than it saves."""

from __future__ import annotations

import numpy as np
import torch

from adapter_fabric.format.tensor_file import host_array

#: below this a CPU row copy runs on one thread (measured: torch's pool waited ~4 ms on a 4.7 MB row; at 84 MB its
#: threads pay off)
SINGLE_THREAD_COPY_BYTES = 32 << 20


def host_copy(dst: torch.Tensor, src: torch.Tensor) -> None:
    """``dst.copy_(src)``; between CPU tensors of one dtype through numpy, on this thread only.

    Measured on 2 loaded cores: torch splits a 0.5 MB copy over its intra-op
    threads and waits 1-10 ms for them to wake, against ~5 us single-threaded;
    staging does hundreds of such copies (224 modules for Llama-3-8B).
    """
    if src.dtype == dst.dtype and src.device.type == "cpu" and dst.device.type == "cpu":
        np.copyto(host_array(dst), host_array(src))
    else:
        dst.copy_(src)
