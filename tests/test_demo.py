from grcompile.demo import main


def test_demo_quick_prints_metrics_speed_and_report(capsys):
    out = main(["--quick"])
    text = capsys.readouterr().out
    assert "test metrics" in text and "hr@10" in text
    assert "speed (median train step" in text and "grcompile" in text
    assert "jagged_rewrite" in text and "jagged_attention" in text  # the report shows what fired
    assert out["eager_ms"] > 0 and out["grcompile_ms"] > 0
