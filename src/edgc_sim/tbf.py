"""The token bucket of the emulated links (tc tbf): how large a burst a link lets through at once.

`edgc bench` gives every host link this burst when it sets the links up (`edgc_bench.netns`), and
the simulator's model of a bench link needs the same number to predict a collective's time
(`edgc_sim.bench_link`); both read it here.
"""


def burst_bytes(rate_mbit: float) -> int:
    """tbf bucket: ~2 ms at the rate, at least 32 KiB (250 kB at 1 Gbit/s).

    A smaller bucket keeps a link below its configured rate (tbf then throttles every burst of a
    large message); measured on this project's machines, about 256 kB at 1 Gbit/s and 32 kB at
    100 Mbit/s reach the rate (the shaped rate is then 91–95 % of nominal).
    """
    return max(32 * 1024, int(rate_mbit * 1e6 / 8 * 0.002))
