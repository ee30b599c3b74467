"""The game through core's Environment contract, as a rollout calls it: reset, a step per turn, close."""

import asyncio

from drivetrain_engine_core.job import ModelTurn
from drivetrain_toy_environment.game import AGAIN, SayTheWord


def test_each_turn_earns_the_share_of_the_words_letters_less_a_half():
    async def play():
        game = SayTheWord(turns=2)
        first = await game.reset({"prompt": "Say sit.", "word": "sit"})
        answers = [
            await game.step(ModelTurn(text=text, token_ids=(1,), turn=k))
            for k, text in enumerate(["is", "x"])
        ]
        await game.close()
        return first, answers

    first, (again, last) = asyncio.run(play())
    assert first == [{"role": "user", "content": "Say sit."}]
    assert (again.reward, again.done, again.observation) == (
        2 / 3 - 0.5,
        False,
        [{"role": "user", "content": AGAIN}],
    )
    assert (last.reward, last.done, last.observation) == (-0.5, True, [])
