"""harvest's SGLang integration: the plugin entry point, hooks and server helpers.

Nothing here is imported by harvest's core; importing these modules imports sglang.
"""

SUPPORTED_SGLANG_VERSION = "0.5.23"
