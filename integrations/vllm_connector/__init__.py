"""SCD as a vLLM KV connector (``KVConnectorBase_V1``): a producer engine on the base model encodes each
layer of a prompt's cache with the project's transfer methods and streams it over the project's wire
protocol; a consumer engine on a fine-tune rebuilds native K/V into its paged cache, layer by layer.

``connector`` imports vLLM; the rest (``engine_model``, ``transfers``) does not, so the receiver's checks
and the encode/decode path are tested in the project's own environment too. See docs/vllm.md.
"""
