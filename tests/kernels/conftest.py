"""Kernel tests run the Triton kernels on CPU tensors through Triton's interpreter."""

import os

os.environ["TRITON_INTERPRET"] = "1"
