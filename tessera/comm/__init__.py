"""Communication between ranks: the process group and its device (``group``), the asynchronous
``all_to_all`` of per-peer row blocks (``exchange``), their wire format (``wire``), stochastic
quantization below 32 bits (``quantize``), exact byte and time accounting (``accounting``), and
read-only arrays mapped once per host (``shared_arrays``). What each rank sends is planned
elsewhere: halo plans and vertex covers in :mod:`tessera.graph.partition`, the strategies that
run them in :mod:`tessera.parallel`."""
