"""The three gRPC services: gateway (public), draft, verifier.

OpenMP threads wait passively in every service process (unless OMP_WAIT_POLICY is set): by default an
OpenMP runtime spins for a while after each parallel region, and with the draft and the verifier on the
same few cores one process's spinning threads delay the other's parallel regions. On the 2-core CPU
(docs/benchmarks.md, "OpenMP wait policy") a speculative 2x4 round through the services took 55.8 ms per
token passive against 62.9 unset, plain decoding the same. It must be set before torch loads its OpenMP
runtime, hence here, in the package every service entry point imports first.
"""

import os

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
