"""`domino-spec demo --tiny`: the self-check that needs no asset package (the real demo is in test_real_model)."""

from domino_spec.generation.demo import run_tiny_demo


def test_tiny_demo_gives_plain_greedy_tokens(capsys):
    run_tiny_demo(max_new_tokens=12)
    assert "identical to plain greedy decoding: True" in capsys.readouterr().out
