"""The SGLang release this contract module serves."""

SGLANG_VERSION = "0.5.23"
