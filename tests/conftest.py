"""The suite runs the Triton kernels on CPU tensors through Triton's interpreter. Set here, before any test module
imports a kernel: a @triton.jit function takes its mode when it is decorated, so a kernel module imported first
without it (any subset of the suite that does not start with tests/kernels) fails later under the interpreter."""

import os

os.environ["TRITON_INTERPRET"] = "1"
