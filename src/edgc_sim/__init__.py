"""Paper-scale simulator of EDGC training (`edgc simulate`).

An analytic cost model of one Megatron-style TP x PP x DP iteration (1F1B pipeline, DP gradient sync
after the flush, ring all-reduces under an alpha-beta model) and of a whole run whose per-stage
PowerSGD ranks follow a method's schedule (uncompressed, static PowerSGD, Optimus-CC-style selective
stages, EDGC with DAC alignment). Pure Python + numpy; no GPU needed.
"""
