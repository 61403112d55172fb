import os

import torch

# Triton kernels run in the interpreter on CPU-only machines. The flag is read when a kernel is
# decorated, so it must be set before imggen.kernels is imported anywhere.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
