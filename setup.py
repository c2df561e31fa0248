"""Only the compiled fast path lives here (metadata is in setup.cfg): shm://'s one-slot
messages in C. ``optional``: a machine without a C compiler or Python headers still
installs, and shm:// runs its Python path (``make deps`` installs both, and CI requires it)."""
from setuptools import Extension, setup

setup(ext_modules=[Extension("transport._shmfast", ["transport/_shmfast.c"], optional=True,
                             extra_compile_args=["-O2", "-Wall", "-Werror=implicit-function-declaration"])])
