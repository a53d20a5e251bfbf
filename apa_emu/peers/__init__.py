"""Peer recipes: other attention kernels emulated bit for bit, so that ``apa check`` can hold a peer's
real kernel on the GPU against its emulation (numerics.md §14 onward). A recipe is independent of APA's
passes; it reuses only the shared primitives (``fpmath``, ``mma``, ``sfu``).
"""
