from grcompile.demo import main


def test_demo_quick_prints_metrics_speed_and_report(capsys):
    out = main(["--quick"])
    text = capsys.readouterr().out
    assert "test metrics" in text and "hr@10" in text
    assert "speed (median train step" in text and "grcompile" in text
    assert "no passes in the pipeline" in text  # said plainly until the passes land
    assert out["eager_ms"] > 0 and out["grcompile_ms"] > 0
