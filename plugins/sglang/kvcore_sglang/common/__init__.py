"""What kvcore-sglang's contract modules share whatever SGLang version they serve.

* :mod:`~kvcore_sglang.common.pool_views`: kvcore's pool protocols over SGLang's allocators,
  ``ReqToTokenPool`` and Mamba pools (every alloc and free is SGLang's own call).
* :mod:`~kvcore_sglang.common.fill_ids`: the token ids a cache call hands kvcore, read from
  SGLang's request arrays, and the per-request tables a cache keeps.
* :mod:`~kvcore_sglang.common.build`: the refusal error, the strict switch, the option
  builders and the build of a kvcore backend on views of SGLang's pools.

Each imports SGLang: only a contract module (``kvcore_sglang.v0_5_19``, ...) imports them.
"""
