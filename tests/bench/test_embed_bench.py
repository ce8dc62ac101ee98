"""``jaxserve bench embed`` on a tiny BERT: both sides agree and every turn is reported."""

import argparse

from jaxserve.bench.embed_bench import add_embed_bench_args, run_embed_bench_cli
from tests.models.test_bert import tiny_bert
from tests.models.test_pooling_config import write_st_folder


def test_embed_bench_reports_agreeing_turns(tmp_path):
    tiny_bert(tmp_path, "BertModel", seed=3)
    write_st_folder(tmp_path, "pooling_mode_mean_tokens", normalize=True)
    parser = argparse.ArgumentParser()
    add_embed_bench_args(parser)
    args = parser.parse_args([str(tmp_path), "--num-texts", "6", "--min-len", "3", "--max-len", "40",
                              "--batch-size", "4", "--turns", "2"])
    result = run_embed_bench_cli(args)
    assert result["min_cosine"] > 0.9999
    assert len(result["turns"]) == 2 and result["ratio_min"] <= result["ratio_median"] <= result["ratio_max"]
    assert 6 * 3 <= result["tokens"] <= 6 * 40
    assert result["jaxserve"]["texts_per_s"] > 0 and result["sentence_transformers"]["tokens_per_s"] > 0
