"""ChatTemplateProcess: request templates render in a child process, as in-process, within memory and time."""

from __future__ import annotations

import asyncio

import pytest

from pagedllm.entrypoints.openai import chat_template
from pagedllm.entrypoints.openai.chat_template_process import ChatTemplateProcess, ChatTemplateProcessError

pytestmark = pytest.mark.slow  # starts a child process

MESSAGES = [{"role": "user", "content": "hi \ud83d"}, {"role": "assistant", "content": "ok"}]
TEMPLATE = "{% for m in messages %}<{{ m.role }}>{{ m.content }}{% endfor %}{% if add_generation_prompt %}>{% endif %}"
OPTIONS = {"add_generation_prompt": True, "continue_final_message": False, "special_tokens": {}, "max_chars": 10**6}


def _alive(pid: int) -> bool:
    """Alive and not a zombie."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] != "Z"
    except OSError:
        return False


def test_renders_like_in_process_and_survives_bombs_timeouts_and_cancellation(monkeypatch):
    # no slack past the render timeout: the server, not the child's own check between lines, ends the sort
    monkeypatch.setattr("pagedllm.entrypoints.openai.chat_template_process.KILL_SLACK_S", 0.0)

    async def scenario():
        process = ChatTemplateProcess()
        try:
            text = await process.render(TEMPLATE, MESSAGES, timeout_s=5.0, **OPTIONS)
            assert text == chat_template.render(TEMPLATE, MESSAGES, timeout_s=5.0, **OPTIONS)
            with pytest.raises(ChatTemplateProcessError, match="too much memory"):  # folded while compiling
                await process.render("{{ '%999999999s' % 'a' }}", MESSAGES, timeout_s=5.0, **OPTIONS)
            with pytest.raises(ChatTemplateProcessError, match="SecurityError"):
                await process.render("{{ ''.__class__ }}", MESSAGES, timeout_s=5.0, **OPTIONS)
            child = process._proc.pid  # seconds inside filters, where the child's own timeout never looks: killed
            with pytest.raises(ChatTemplateProcessError, match="longer than 0.2 s"):
                await process.render("{{ (range(99999)|list * 3)|map('string')|sort|unique|list|length }}", MESSAGES,
                                     timeout_s=0.2, **OPTIONS)
            assert process._proc is None  # the busy child is gone, not left sorting; the next render starts another
            await asyncio.sleep(0.2)  # the loop reaps it
            assert not _alive(child)
            slow = asyncio.ensure_future(process.render("{% for i in range(10**5) %}{% for j in range(10**5) %}"
                                                        "{% endfor %}{% endfor %}", MESSAGES, timeout_s=5.0,
                                                        **OPTIONS))
            await asyncio.sleep(0.5)
            slow.cancel()  # the client left mid-render: its answer must not reach the next request
            with pytest.raises(asyncio.CancelledError):
                await slow
            assert await process.render(TEMPLATE, MESSAGES, timeout_s=5.0, **OPTIONS) == text
        finally:
            process.close()
            await asyncio.sleep(0.2)  # the loop sees the killed children exit

    asyncio.run(scenario())
