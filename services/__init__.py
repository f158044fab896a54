"""The three gRPC services: gateway (public), draft, verifier.

OpenMP threads wait passively in every service process (unless OMP_WAIT_POLICY is set): by default an
OpenMP runtime spins for a while after each parallel region, and with the draft and the verifier on the
same few cores each one's spinning threads stall the other's next parallel region until the scheduler's
time slice ends. Measured on the 2-core CI machine kind with other processes running: a [2, 576] x
[576, 1728] matrix product (every verify step has 121 of them) took 16 ms spinning and 0.13 ms passive;
single-row products (plain decoding) are not parallelised and were unaffected. It must be set before
torch loads its OpenMP runtime, hence here, in the package every service entry point imports first.
"""

import os

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
