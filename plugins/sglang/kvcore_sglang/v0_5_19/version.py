"""The SGLang release this contract module is written against."""

SGLANG_VERSION = "0.5.19"
