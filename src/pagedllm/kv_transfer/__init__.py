"""KV connectors: moving KV blocks between the engine's pool and elsewhere (vLLM's kv_transfer). base.py is the
seam, factory.py the registry by name, multi_connector.py chains several."""
