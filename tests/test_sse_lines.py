"""A streamed chunk is one SSE line for every client: JSON leaves U+0085, U+2028 and U+2029 raw, and
line splitters that follow str.splitlines (httpx's aiter_lines) break there."""

import json

from httpx._decoders import LineDecoder

from specserve.server.api import _sse


def test_unicode_line_breaks_in_text_stay_inside_one_sse_line():
    text = "a\u2028b\x85c\u2029d é"
    frame = _sse({"choices": [{"delta": {"content": text}}]})
    lines = [line for line in LineDecoder().decode(frame.decode()) if line]
    assert len(lines) == 1 and lines[0].startswith("data: ")
    assert json.loads(lines[0][len("data: "):])["choices"][0]["delta"]["content"] == text
