"""Prompt files: JSONL and Parquet, plain and DAPO forms, chat template, bad rows, long prompts."""
import json

import pytest

from megatron_tepo.data import DataError, load_prompts


class CharTokenizer:
    """A stand-in with the two calls the loader makes (real tokenizers are tested elsewhere)."""

    chat_template = "x"

    def __call__(self, text, add_special_tokens=False):
        return {"input_ids": [ord(c) for c in text]}

    def apply_chat_template(self, messages, add_generation_prompt=True, tokenize=True):
        text = "".join(f"<{m['role']}>{m['content']}" for m in messages) + ("<assistant>" if add_generation_prompt else "")
        return [ord(c) for c in text]


def write_jsonl(path, rows):
    path.write_text("\n".join(r if isinstance(r, str) else json.dumps(r) for r in rows) + "\n")
    return path


def test_plain_and_dapo_forms_jsonl(tmp_path):
    f = write_jsonl(tmp_path / "a.jsonl", [
        {"prompt": "1+1?", "answer": "2"},
        {"prompt": [{"role": "user", "content": "2+2?"}], "reward_model": {"ground_truth": "4"},
         "data_source": "dapo"},
        {"prompt": "3+3?", "answer": 6},
    ])
    ps = load_prompts(f, CharTokenizer())
    assert [r.answer for r in ps.records] == ["2", "4", "6"]
    assert ps.records[0].input_ids == [ord(c) for c in "<user>1+1?<assistant>"]
    assert ps.records[1].source.endswith("a.jsonl:2")
    raw = load_prompts(f, CharTokenizer(), apply_chat_template=False)
    assert raw.records[0].input_ids == [ord(c) for c in "1+1?"]


def test_parquet(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    table = pa.Table.from_pylist([
        {"prompt": [{"role": "user", "content": "5-1?"}], "reward_model": {"ground_truth": "4"}},
        {"prompt": [{"role": "user", "content": "9-1?"}], "reward_model": {"ground_truth": "8"}},
    ])
    pq.write_table(table, tmp_path / "d.parquet")
    ps = load_prompts(tmp_path / "d.parquet", CharTokenizer())
    assert [r.answer for r in ps.records] == ["4", "8"] and ps.records[1].source.endswith("d.parquet:2")


def test_too_long_dropped_and_counted(tmp_path):
    f = write_jsonl(tmp_path / "a.jsonl", [{"prompt": "x" * 50, "answer": "1"}, {"prompt": "ok", "answer": "1"}])
    ps = load_prompts(f, CharTokenizer(), max_prompt_len=30)
    assert len(ps) == 1 and ps.num_too_long == 1


@pytest.mark.parametrize("row, needle", [
    ('{"prompt": "a"', "invalid JSON"),
    ({"question": "a", "answer": "1"}, "missing field 'prompt'"),
    ({"prompt": "a"}, "missing field 'answer'"),
    ({"prompt": 3, "answer": "1"}, "field 'prompt' must be a string or a list"),
    ({"prompt": [{"role": "user"}], "answer": "1"}, r"prompt\[0\]"),
    ({"prompt": "a", "answer": ""}, "answer must be a non-empty string"),
    ("[1, 2]", "row is a list"),
])
def test_bad_row_names_file_and_line(tmp_path, row, needle):
    f = write_jsonl(tmp_path / "bad.jsonl", [{"prompt": "fine", "answer": "1"}, row])
    with pytest.raises(DataError, match=rf"bad.jsonl:2: .*{needle}"):
        load_prompts(f)
    skipped = load_prompts(f, on_bad_row="skip")
    assert len(skipped) == 1 and skipped.num_bad_rows == 1 and "bad.jsonl:2" in skipped.bad_rows[0]


def test_missing_file_and_bad_suffix(tmp_path):
    with pytest.raises(DataError, match="no such file"):
        load_prompts(tmp_path / "nope.jsonl")
    (tmp_path / "x.csv").write_text("a,b\n")
    with pytest.raises(DataError, match="unsupported file type '.csv'"):
        load_prompts(tmp_path / "x.csv")


def test_a_row_keeps_every_field_and_an_answer_may_be_left_out_on_request(tmp_path):
    """#58 item 1: the row's other fields (tests, a secret, an id) reach the reward and the environment."""
    path = tmp_path / "task.jsonl"
    write_jsonl(path, [{"prompt": "guess", "answer": 7, "secret": 37, "tests": ["assert f(1) == 2"]},
                       {"prompt": [{"role": "user", "content": "q"}], "reward_model": {"ground_truth": "5"}, "id": "b"}])
    rows = [r.row for r in load_prompts(path).records]
    assert rows[0] == {"prompt": "guess", "answer": "7", "secret": 37, "tests": ["assert f(1) == 2"]}
    assert rows[1]["id"] == "b" and rows[1]["answer"] == "5" and rows[1]["reward_model"] == {"ground_truth": "5"}
    write_jsonl(path, [{"prompt": "guess", "secret": 37}])
    with pytest.raises(DataError, match="missing field 'answer'"):
        load_prompts(path)
    (record,) = load_prompts(path, require_answer=False).records
    assert record.answer == "" and record.row == {"prompt": "guess", "secret": 37, "answer": ""}
