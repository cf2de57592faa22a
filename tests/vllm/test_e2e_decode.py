"""A decode retention through a real vLLM engine (CPU build, float32, greedy): the chunks of
what a request generates are stored at its ``decode_priority``, and the next turn, whose
prompt starts with that answer, loads them; its tokens equal those computed without a load.
"""

from __future__ import annotations

from typing import Any

import e2e
import pytest
from e2e import tier_tokens

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

PROMPT = e2e.prompts([1000], seed=22)[0]  # chunks 0-2 prompt, 3 straddles, 4 generated
ANSWER = 290


server, llm = e2e.engine_fixtures("kvtier-decode")


def test_the_answer_is_stored_at_the_decode_priority_and_the_next_turn_loads_it(
        llm: Any) -> None:
    turn = e2e.generate(llm, [PROMPT], max_tokens=ANSWER,
                        retention={"priority": 60, "decode_priority": 90,
                                   "decode_duration_s": 300})
    answer = turn.tokens[0]
    assert len(answer) == ANSWER
    assert turn.kvtier[0]["stored_chunks"] == (len(PROMPT) + ANSWER - 1) // 256 == 5
    nxt = PROMPT + answer + e2e.prompts([100], seed=23)[0]
    llm.reset_prefix_cache()
    computed = e2e.generate(llm, [nxt], load=False)
    llm.reset_prefix_cache()
    loaded = e2e.generate(llm, [nxt])
    assert loaded.tokens == computed.tokens
    assert tier_tokens(loaded.kvtier[0], "arena") == 5 * 256, "the answer's chunks too"
