"""Compile-only runs for accelerator targets on any host (`ling-jax aot`).

`targets` names the devices (libtpu topologies, NVIDIA nodes from a target description),
`abstract` builds the loader's shape-only model and the engine's pools placed on them (nothing read or
allocated), `programs` lists what the runtime would compile (cache-free forward, generate's prefill and
decode, the engine's programs), `analysis` reads the compiler's memory, cost and collectives.
"""
