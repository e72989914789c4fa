"""The device layer: streams, device-timeline timing and the only host reads, a step's totals, finiteness
flags, graph regions.

Modules:
    streams.py The library's streams and stream-ordered memory, in one device-agnostic place.
    timing.py  Device-timeline timestamps and the library's only device→host reads.
    totals.py  A step's values for the host, by name: added by each part, sent as one device tensor, read once.
    finite.py  Finiteness flags that cannot overflow: is every element of a tensor finite, on the device.
    graphs.py  Graph regions: a named stretch of work over fixed buffers, eager or replayed from a CUDA graph.
"""
