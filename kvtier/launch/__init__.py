"""``kvtier serve``: one vLLM instance with its node server, or a stack of N behind a router.

The launcher starts processes and never imports vLLM or torch itself (the instances it starts
do, through :mod:`kvtier.vllm`). It depends on the connector's config only, never on the
benchmarks: peers such as vllm-router are installed by ``kvtier bench peers --install``, and
``kvtier serve`` only finds them (:mod:`kvtier.launch.vllm_router`).
"""
