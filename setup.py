"""Only the compiled fast paths live here (metadata is in setup.cfg): shm://'s one-slot
messages, rdma://'s small SENDs, tcp://'s one-slot messages and the gateway's combine in
C. ``optional``: a machine without a C compiler, Python headers or verbs.h still installs,
and each backend runs its Python path (``make deps`` builds all four, and CI requires
them)."""
from setuptools import Extension, setup

FLAGS = ["-O2", "-Wall", "-Werror=implicit-function-declaration"]
setup(ext_modules=[
    Extension("transport._shmfast", ["transport/_shmfast.c"], depends=["transport/_fastpath.h"], optional=True,
              extra_compile_args=FLAGS),
    # only verbs.h's inline calls: it needs the header (libibverbs-dev), not the library
    Extension("transport._rdmafast", ["transport/_rdmafast.c"], depends=["transport/_fastpath.h"], optional=True,
              extra_compile_args=FLAGS),
    Extension("transport._tcpfast", ["transport/_tcpfast.c"], depends=["transport/_fastpath.h"], optional=True,
              extra_compile_args=FLAGS),
    # the gateway's combine: -O3 vectorizes its row loops; no fused multiply-add, so it
    # rounds as numpy's multiply-then-add does and gives the same bits
    Extension("gateway._combine", ["gateway/_combine.c"], optional=True,
              extra_compile_args=FLAGS + ["-O3", "-ffp-contract=off"]),
])
