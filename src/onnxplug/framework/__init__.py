"""Runtime machinery: memory and allocators, streams and transfers, the kernel API, the
executor and host-provided kernels (copies, control flow)."""
