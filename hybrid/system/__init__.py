"""Facts about this machine and the process's use of it: devices, thread pinning, NUMA, mlock, libc, sizes."""
