import os

# torch._dynamo is imported lazily by the DDP constructor (about 1.4 s per process); import it once in
# the parent so forked test workers inherit it.
import torch
import torch._dynamo  # noqa: F401

os.environ.setdefault("TORCH_CPP_LOG_LEVEL", "ERROR")
