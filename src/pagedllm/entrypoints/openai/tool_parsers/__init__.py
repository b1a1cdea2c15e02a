"""Tool call parsers (`--tool-call-parser`; `server_config.TOOL_CALL_PARSERS` lists them) and the chat template shipped
for them (`tool_chat_template_hermes.jinja`)."""
