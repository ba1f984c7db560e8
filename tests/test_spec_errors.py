"""Malformed specs get a precise message: file, field path, what is wrong, what is allowed."""

import textwrap

import pytest

import archlab
import archlab.ffn
from archlab.train.config import load_config
from conftest import ROOT

BASE = """
schema_version: 1
name: t
vocab_size: 64
d_model: 32
layout:
  type: yoco
  self_decoder: {n_layers: 2, blocks: [{type: swa, window: 8, n_heads: 4}]}
  global_kv: {n_kv_heads: 2, head_dim: 8}
  cross_decoder: {n_layers: 2}
"""

STACK = """
schema_version: 1
name: t
vocab_size: 64
d_model: 32
layout:
  type: stack
  layers: {n_layers: 4, blocks: [{type: attention, n_heads: 4}]}
"""

# (name, files {name: text}, spec to load, [fragments the message must contain])
CASES = [
    ("yaml syntax", {"s.yaml": "name: [unclosed\n"}, "s.yaml", ["YAML syntax error", "line 2"]),
    ("not a mapping", {"s.yaml": "- a\n- b\n"}, "s.yaml", ["the file must be a YAML mapping (key: value lines), got list"]),
    ("empty", {"s.yaml": "# nothing yet\n"}, "s.yaml", ["<root>: the file is empty; it must be a YAML mapping"]),
    ("wrong type", {"s.yaml": BASE.replace("d_model: 32", "d_model: wide")}, "s.yaml",
     ["d_model:", "valid integer", "'wide'"]),
    ("blank name", {"s.yaml": BASE.replace("name: t", "name: '  '")}, "s.yaml",
     ["name: a name is one line of text, with no space at either end (got '  ')"]),
    ("name over two lines", {"s.yaml": BASE.replace("name: t", 'name: "t\\nu"')}, "s.yaml", ["name: a name is one line of text", "'t\\nu'"]),
    ("negative width", {"s.yaml": BASE.replace("d_model: 32", "d_model: -4")}, "s.yaml",
     ["d_model:", "greater than 0"]),
    ("an exponent YAML reads as text", {"s.yaml": BASE.replace("window: 8", "window: 1e3")}, "s.yaml",
     ["layout.self_decoder.blocks[0].window: must be a whole number; YAML reads 1e3 as text, not a number: write 1000"]),
    ("a number past a whole number's", {"s.yaml": BASE + "ffn: {hidden: 1.0e+308}\n"}, "s.yaml", ["ffn.hidden: is too large a number (got 1e+308)"]),
    ("a block's size past any model's", {"s.yaml": BASE.replace("window: 8", "window: 8, head_dim: 1000000000000000000000000000000")},
     "s.yaml", ["layout.self_decoder.blocks[0].head_dim: Input should be less than or equal to 1048576"]),
    ("a value head size past any model's", {"s.yaml": STACK.replace("type: attention", "type: gdn, expand_v: 1.0e+300")}, "s.yaml",
     ["layout.layers.blocks[0].expand_v: expand_v * head_dim = 8e+300, a value head size past 1,048,576"]),
    ("an FFN past any model's", {"s.yaml": BASE + "ffn: {type: moe, n_experts: 4, top_k: 2, expert_hidden: 2097152}\n"}, "s.yaml",
     ["ffn.expert_hidden: Input should be less than or equal to 1048576"]),
    ("infinite rope theta", {"s.yaml": BASE.replace("n_layers: 2, blocks", "n_layers: 2, position: {type: rope, theta: .inf}, blocks")},
     "s.yaml", ["layout.self_decoder.position.theta:", "finite number"]),
    ("rope theta of 1", {"s.yaml": BASE.replace("n_layers: 2, blocks", "n_layers: 2, position: {type: rope, theta: 1}, blocks")},
     "s.yaml", ["layout.self_decoder.position.theta:", "greater than 1"]),
    ("yes for a number", {"s.yaml": BASE.replace("window: 8", "window: yes")}, "s.yaml",  # YAML's yes is true, pydantic's true 1
     ["layout.self_decoder.blocks[0].window: got true, a yes/no value where a number is wanted"]),
    ("yes for a number beside other problems", {"s.yaml": BASE.replace("d_model: 32", "d_model: yes\ndropout: 0.1").replace(
        "window: 8, n_heads: 4", "window: 1e3, n_heads: no")}, "s.yaml",  # each was hidden behind the mapping's yes/no value
     ["d_model: got true, a yes/no value", "dropout: unknown key", "blocks[0].n_heads: got false, a yes/no value",
      "blocks[0].window: must be a whole number; YAML reads 1e3 as text"]),
    ("key given twice", {"s.yaml": BASE + "d_model: 48\n"}, "s.yaml", ["line 11, column 1", "key 'd_model' given twice (first on line 5)"]),
    ("empty name", {"s.yaml": BASE.replace("name: t", "name: ''")}, "s.yaml", ["name:", "at least 1 character"]),
    ("unknown key", {"s.yaml": BASE + "dropout: 0.1\n"}, "s.yaml", ["dropout:", "unknown key"]),
    ("unknown nested key", {"s.yaml": BASE.replace("window: 8", "window: 8, widow: 3")}, "s.yaml",
     ["layout.self_decoder.blocks[0].widow", "unknown key"]),
    ("unknown block type", {"s.yaml": BASE.replace("type: swa", "type: lstm")}, "s.yaml",
     ["layout.self_decoder.blocks[0]", "unknown type 'lstm'", "'attention'", "'gdn'", "'mamba2'", "'retnet'", "'swa'",
      "(blocks come from installed archlab.blocks plugins; `archlab blocks` lists them)"]),
    ("unknown layout", {"s.yaml": BASE.replace("type: yoco", "type: encoder")}, "s.yaml",
     ["layout", "unknown type 'encoder'", "'stack'", "'yoco'"]),
    ("schema version", {"s.yaml": BASE.replace("schema_version: 1", "schema_version: 7")}, "s.yaml",
     ["schema_version", "unsupported schema_version 7", "version 1"]),
    ("missing field", {"s.yaml": BASE.replace("vocab_size: 64\n", "")}, "s.yaml", ["vocab_size", "Field required"]),
    ("huge vocabulary", {"s.yaml": BASE.replace("vocab_size: 64", "vocab_size: 99999999999999999999999")}, "s.yaml",
     ["vocab_size:", "less than or equal to 2147483647"]),
    ("heads vs width", {"s.yaml": BASE.replace("n_heads: 4", "n_heads: 5")}, "s.yaml",
     ["layout.self_decoder.blocks[0].n_heads", "5 heads do not divide d_model=32", "allowed: one of [1, 2, 4, 8, 16], or set"]),  # 32 heads of 1 channel: odd, under RoPE
    ("odd retnet head_dim under rope", {"s.yaml": STACK.replace("{type: attention, n_heads: 4}", "{type: retnet, n_heads: 4, head_dim: 7}")},
     "s.yaml", ["layout.layers.blocks[0].head_dim: RoPE needs an even head_dim, got 7"]),
    ("extends a path with a NUL byte", {"s.yaml": 'extends: "a\\0b.yaml"\nname: e\n'}, "s.yaml",
     ["extends: a path cannot hold a NUL byte"]),  # a ValueError traceback
    ("extends a name too long", {"s.yaml": f"extends: {'a' * 300}.yaml\nname: e\n"}, "s.yaml",
     ["<file>: cannot read: File name too long (extended from"]),  # an OSError, named by the command but not as the spec's
    ("odd retnet head_dim derived under rope", {"s.yaml": STACK.replace("{type: attention, n_heads: 4}", "{type: retnet, n_heads: 32}")},
     "s.yaml", ["layout.layers.blocks[0].head_dim: RoPE needs an even head_dim, got 1 (d_model=32 // n_heads=32); set head_dim,"
                " or n_heads that leave it even"]),
    ("kv heads vs heads", {"s.yaml": BASE.replace("n_heads: 4", "n_heads: 4, n_kv_heads: 3")}, "s.yaml",
     ["n_kv_heads=3 must divide n_heads=4"]),
    ("cross heads vs global kv", {"s.yaml": BASE.replace("n_kv_heads: 2", "n_kv_heads: 3")}, "s.yaml",
     ["layout.cross_decoder.blocks[0].n_heads", "multiple of the global K,V's 3 heads"]),
    ("loop outside stack", {"s.yaml": STACK + "loop: {position: range, start: 2, end: 9, times: 2, kv_cache: shared}\n"},
     "s.yaml", ["loop:", "layers 2..8 are outside the stack of 4 layers (0..3)"]),
    ("shorthand missing its fields", {"s.yaml": STACK + "loop: range\n"}, "s.yaml",
     ["loop.times: Field required", "loop.start: Field required", "loop.end: Field required"]),
    ("prefix longer than stack", {"s.yaml": STACK + "loop: {position: prefix, n_layers: 6, times: 2}\n"},
     "s.yaml", ["loop:", "outside the stack of 4 layers"]),
    ("loop straddles yoco halves", {"s.yaml": BASE + "loop: {position: range, start: 1, end: 3, times: 2}\n"},
     "s.yaml", ["straddle the global K,V projection", "self-decoder (0..1)", "cross-decoder (2..3)"]),
    ("all-stack loop in yoco", {"s.yaml": BASE + "loop: {position: all, times: 2}\n"}, "s.yaml",
     ["loop.position: 'all' loops a plain stack; in a YOCO layout, 'lower' loops the self-decoder (0..1) and 'upper' the cross-decoder (2..3)"]),
    ("upper loop on a stack", {"s.yaml": STACK + "loop: {position: upper, times: 2}\n"}, "s.yaml",
     ["loop.position", "names a YOCO half", "'prefix', 'all' or 'range'"]),
    ("cache option over blocks that keep no K,V",
     {"s.yaml": BASE.replace("type: swa, window: 8", "type: gdn") + "loop: {position: lower, times: 3, kv_cache: shared}\n"},
     "s.yaml", ["loop.kv_cache", "not applicable: layers 0..1 keep no K,V cache that iterations could share (blocks: gdn)"]),
    ("cache option missing", {"s.yaml": BASE + "loop: {position: upper, times: 3}\n"}, "s.yaml",
     ["loop.kv_cache", "required", "cross_attention", "'shared'", "'per_iteration'"]),
    ("bad cache option", {"s.yaml": BASE + "loop: {position: upper, times: 3, kv_cache: some}\n"}, "s.yaml",
     ["loop.kv_cache", "'shared' or 'per_iteration'"]),
    ("loop keys of another position", {"s.yaml": BASE + "loop: {position: lower, times: 3, n_layers: 1}\n"}, "s.yaml",
     ["loop.n_layers", "unknown key"]),
    ("zero loop count", {"s.yaml": BASE + "loop: {position: lower, times: 0}\n"}, "s.yaml",
     ["loop.times", "greater than or equal to 1"]),
    ("unknown loop position", {"s.yaml": BASE + "loop: {position: middle, times: 2}\n"}, "s.yaml",
     ["loop", "unknown position 'middle'", "'lower'", "'upper'", "'prefix'"]),
    ("one block for a list", {"s.yaml": BASE.replace("blocks: [{type: swa, window: 8, n_heads: 4}]", "blocks: gdn")}, "s.yaml",
     ["layout.self_decoder.blocks: is a list (a pattern of blocks), not the one block 'gdn': write [gdn]"]),
    ("blocks as a quoted list", {"s.yaml": BASE.replace("blocks: [{type: swa, window: 8, n_heads: 4}]", 'blocks: "[gdn]"')}, "s.yaml",
     ["layout.self_decoder.blocks: is a list (a pattern of blocks), not the text '[gdn]'; YAML reads a list in quotes as"
      " text: write it without them"]),  # was told to write [[gdn]]
    ("keys that are not text", {"s.yaml": BASE + "true: 3\nnull: 4\n"}, "s.yaml",
     ["<root>: the key true is read by YAML as a boolean, not text: quote it",
      "<root>: the key null is read by YAML as null, not text: quote it"]),  # at [1] and None
    ("blocks blank", {"s.yaml": BASE.replace("blocks: [{type: swa, window: 8, n_heads: 4}]", 'blocks: " "')}, "s.yaml",
     ["layout.self_decoder.blocks: is a list (a pattern of blocks), not the text ' '"]),  # was told to write [ ]
    ("a null kind", {"s.yaml": BASE + "loop: {position: null, times: 2}\nffn: {type: 3}\n"}, "s.yaml",
     ["loop: unknown position null; allowed:", "ffn: unknown type 3; allowed:"]),
    ("null for a kind", {"s.yaml": BASE.replace("n_layers: 2, blocks: [{type: swa, window: 8, n_heads: 4}]",
                                                "n_layers: 2, position: null, blocks: [swa, 3]") + "norm: null\nloop: null\n"},
     "s.yaml", ["layout.self_decoder.position: unknown type null; allowed: 'rope', 'none'",
                "norm: unknown type null; allowed: 'rmsnorm', 'layernorm'",
                "loop: unknown position null; allowed: 'none', 'lower', 'upper', 'prefix', 'all', 'range'",
                "layout.self_decoder.blocks[1]: unknown type 3; allowed: 'attention', 'cross_attention',",
                "(blocks come from installed archlab.blocks plugins"]),
    ("a layout given as its kind alone", {"s.yaml": STACK.split("layout:")[0] + "layout: stack\n"}, "s.yaml",
     ["layout: must be a mapping with a type (one of: 'stack', 'yoco') and its fields, got 'stack'"]),
    ("cross-attention in a stack", {"s.yaml": STACK.replace("[{type: attention, n_heads: 4}]", "[cross_attention]")},
     "s.yaml", ["layout.layers.blocks[0].type", "reads the global K,V", "only in a YOCO cross-decoder"]),
    ("self-attention in the cross-decoder", {"s.yaml": BASE.replace("cross_decoder: {n_layers: 2}", "cross_decoder: {n_layers: 2, blocks: [swa]}")},
     "s.yaml", ["layout.cross_decoder.blocks[0].type", "does not read the global K,V", "['cross_attention']"]),
    ("moe top-k", {"s.yaml": BASE + "ffn: {type: moe, n_experts: 4, top_k: 6, expert_hidden: 16}\n"}, "s.yaml",
     ["ffn.top_k", "top_k=6 exceeds n_experts=4"]),
    ("parscale without prefix k,v", {"s.yaml": BASE.replace("type: swa, window: 8, n_heads: 4", "type: gdn, n_heads: 4") + "parscale: {streams: 2}\n"},
     "s.yaml", ["parscale", "no block here supports it", "['attention', 'swa']"]),
    ("mamba head_dim", {"s.yaml": BASE.replace("{type: swa, window: 8, n_heads: 4}", "{type: mamba2, head_dim: 24}")},
     "s.yaml", ["layout.self_decoder.blocks[0].head_dim", "head_dim=24 must divide expand * d_model = 64"]),
    ("extends missing file", {"s.yaml": "extends: nowhere.yaml\nname: x\n"}, "s.yaml", ["nowhere.yaml", "not found", "extended from"]),
    ("extends cycle", {"a.yaml": "extends: b.yaml\nname: a\n", "b.yaml": "extends: a.yaml\nname: b\n"}, "a.yaml",
     ["extends", "cycle", "a.yaml -> ", "b.yaml -> ", "a.yaml"]),
    ("extends not a path", {"s.yaml": "extends: [1, 2]\nname: x\n"}, "s.yaml", ["extends", "must be a path"]),
    ("extends too deep", {**{f"s{i}.yaml": f"extends: s{i + 1}.yaml\nname: x\n" for i in range(1200)}, "s1200.yaml": BASE}, "s0.yaml",
     ["extends", "a chain of more than 100 files"]),
    ("missing spec file", {}, "absent.yaml", ["absent.yaml", "not found"]),
    ("no blocks", {"s.yaml": STACK.replace("[{type: attention, n_heads: 4}]", "[]")}, "s.yaml",
     ["layout.layers.blocks: Value error, give at least one block"]),
    ("block without a type", {"s.yaml": BASE.replace("{type: swa, window: 8, n_heads: 4}", "{window: 8}")}, "s.yaml",
     ["layout.self_decoder.blocks[0]: missing 'type', which says what kind this is (one of: attention, cross_attention, gdn,"]),
    ("loop without a position", {"s.yaml": BASE + "loop: {times: 2}\n"}, "s.yaml",
     ["loop: missing 'position', which says what kind this is (one of: none, lower, upper, prefix, all, range)"]),
    ("range loop ending before it starts", {"s.yaml": STACK + "loop: {position: range, start: 2, end: 1, times: 2}\n"}, "s.yaml",
     ["loop.end: 1 must be past start (2)"]),
    ("global head wider than the model", {"s.yaml": BASE.replace("head_dim: 8", "head_dim: 64")}, "s.yaml",
     ["layout.cross_decoder.blocks[0].n_heads: d_model=32 is not a multiple of the global K,V's head_dim 64, so the"
      " query heads cannot be derived from it; give n_heads"]),
    ("global head not tiling the model", {"s.yaml": BASE.replace("head_dim: 8", "head_dim: 12")}, "s.yaml",
     ["layout.cross_decoder.blocks[0].n_heads: d_model=32 is not a multiple of the global K,V's head_dim 12"]),
    ("global head wider than the model, heads given",
     {"s.yaml": BASE.replace("cross_decoder: {n_layers: 2}", "cross_decoder: {n_layers: 2, blocks: [{type: cross_attention, n_heads: 3}]}")},
     "s.yaml", ["layout.cross_decoder.blocks[0].n_heads: 3 query heads must be a multiple of the global K,V's 2 heads"]),
    ("a pattern longer than its layers", {"s.yaml": STACK.replace("n_layers: 4, blocks: [{type: attention, n_heads: 4}]",
                                                                  "n_layers: 2, blocks: [attention, attention, swa]")},
     "s.yaml", ["layout.layers.blocks: 3 blocks for 2 layers: the pattern's blocks past layer 2 would never be built"]),
    ("a width past any model", {"s.yaml": BASE.replace("d_model: 32", "d_model: 100000000000000000001")}, "s.yaml",
     ["d_model: Input should be less than or equal to 1048576"]),
    ("layers past any model", {"s.yaml": STACK.replace("n_layers: 4", "n_layers: 10000000")}, "s.yaml",
     ["layout.layers.n_layers: Input should be less than or equal to 1024"]),
    ("a loop past any model", {"s.yaml": BASE + "loop: {position: lower, times: 10000000}\n"}, "s.yaml",
     ["loop.times: Input should be less than or equal to 256"]),
    ("a number too long to read", {"s.yaml": BASE.replace("d_model: 32", "d_model: 1" + "0" * 5000)}, "s.yaml",
     ["<yaml>: cannot read a value: Exceeds the limit (4300 digits) for integer string conversion"]),
    ("a count derived from a parent's value", {"s.yaml": "extends: base.yaml\nd_model: 40\n", "base.yaml": BASE}, "s.yaml",
     ["n_heads: 5 query heads", "(n_heads unset: d_model // layout.global_kv.head_dim = 40 // 8 = 5; give n_heads)"]),
    ("a bad value from the file extended", {"s.yaml": "extends: base.yaml\nname: child\n", "base.yaml": BASE.replace("d_model: 32", "d_model: -4")},
     "s.yaml", ["d_model: Input should be greater than 0 (got -4) (set in ", "base.yaml)"]),
    ("a parent's ffn turned into another kind",  # the SwiGLU's hidden is gone with its kind: neither reported nor blamed
     {"s.yaml": "extends: base.yaml\nname: c\nffn: {type: moe, n_experts: 4, top_k: 2}\n",
      "base.yaml": STACK + "ffn: {type: swiglu, hidden: -4}\n"}, "s.yaml", ["ffn.expert_hidden: Field required"]),
    ("a parent's value replaced by a list", {"s.yaml": "extends: base.yaml\nname: [1, 2]\n", "base.yaml": STACK}, "s.yaml",
     ["name: Input should be a valid string"]),
    ("a bad value of the file's own", {"s.yaml": "extends: base.yaml\nd_model: -4\n", "base.yaml": BASE}, "s.yaml",
     ["d_model: Input should be greater than 0 (got -4)"]),
    ("a folder", {"d/s.yaml": BASE}, "d", ["<file>: is a folder, not a YAML file"]),
    ("an alias inside itself", {"s.yaml": BASE + "extra: &a [*a]\n"}, "s.yaml", ["an alias refers to a value that contains it"]),
    ("an alias bomb", {"s.yaml": BASE + "a: &a [x, x, x, x, x, x, x, x, x, x]\n" + "".join(
        f"{chr(98 + i)}: &{chr(98 + i)} [{', '.join([f'*{chr(97 + i)}'] * 10)}]\n" for i in range(9))}, "s.yaml",
     ["its aliases expand to over 100,000 values"]),
    ("nested past reading", {"s.yaml": BASE + "deep: " + "[" * 3000 + "]" * 3000 + "\n"}, "s.yaml", ["<yaml>: nested too deeply to read"]),
    ("extends a folder", {"s.yaml": "extends: d\nname: x\n", "d/t.yaml": BASE}, "s.yaml", ["is a folder, not a YAML file (extended from"]),
    ("extends nothing", {"s.yaml": "extends: ' '\nname: x\n"}, "s.yaml", ["extends: must be a path to another spec file"]),  # not "." read as a folder
]


def test_a_spec_that_is_no_regular_file_is_not_said_to_be_missing():
    with pytest.raises(archlab.SpecError, match="<file>: is not a regular file"):
        archlab.load_spec("/dev/null")


def test_a_run_whose_spec_is_a_link_to_itself_is_named_not_a_traceback(cli, tmp_path):
    """A run folder's spec.yaml replaced by a symbolic link that leads back to itself (an edit or a
    copy gone wrong) is refused like any unreadable spec, naming the file, by every command that
    reads a run's spec (show, cost, a resume): it raised Python's RuntimeError from the cycle check."""
    run = tmp_path / "run"
    (run / "checkpoints").mkdir(parents=True)
    (run / "spec.yaml").symlink_to(run / "spec.yaml")
    with pytest.raises(archlab.SpecError, match="symbolic link"):
        archlab.load_spec(run / "spec.yaml")
    for command in (["show", run], ["cost", run], ["train", run, "--out", run, "--resume"]):
        code, _, err = cli(*command)
        assert code == 1 and "spec.yaml" in err and "symbolic link" in err, (command, code, err)


def test_a_file_missing_down_an_extends_chain_names_the_file_that_extended_it(tmp_path):
    """The file to mend is the one whose ``extends`` names the missing file, not the one given on
    the command line: in a chain a -> b -> nowhere, the message points at b."""
    (tmp_path / "a.yaml").write_text("extends: b.yaml\nname: a\n")
    (tmp_path / "b.yaml").write_text("extends: nowhere.yaml\nname: b\n")
    with pytest.raises(archlab.SpecError) as caught:
        archlab.load_spec(tmp_path / "a.yaml")
    assert str(caught.value) == f"{tmp_path / 'nowhere.yaml'}: 1 problem(s)\n  <file>: not found (extended from {tmp_path / 'b.yaml'})"


def test_a_spec_given_that_does_not_exist_is_said_to_be_no_such_file(tmp_path):
    """A spec named on the command line that is not there is said so plainly, with nothing about
    ``extends``, which no file asked for."""
    with pytest.raises(archlab.SpecError) as caught:
        archlab.load_spec(tmp_path / "missing.yaml")
    assert str(caught.value) == f"{tmp_path / 'missing.yaml'}: 1 problem(s)\n  <file>: not found (no such file)"


@pytest.mark.parametrize("target, said", [("link.yaml", "is a symbolic link that leads back to itself, not a YAML file"),
                                          ("nowhere.yaml", "is a symbolic link to nothing, or in a loop")], ids=["itself", "nothing"])
def test_a_link_reached_through_extends_names_it_and_the_file_that_extended_it(tmp_path, target, said):
    """A parent spec replaced by a symbolic link that leads back to itself, or to nothing, is named
    as the file at fault, with the spec whose ``extends`` led to it, as a missing parent or a folder is."""
    (tmp_path / "link.yaml").symlink_to(tmp_path / target)
    (tmp_path / "s.yaml").write_text("extends: link.yaml\nname: x\n")
    with pytest.raises(archlab.SpecError) as caught:
        archlab.load_spec(tmp_path / "s.yaml")
    assert str(caught.value) == f"{tmp_path / 'link.yaml'}: 1 problem(s)\n  <file>: {said} (extended from {tmp_path / 's.yaml'})"


def test_an_unknown_key_set_with_a_name_beginning_in_digits_is_traced_to_the_override():
    """Only a whole-number part of a dotted path is a list index: an unknown key such as ``2x``
    under ``blocks.0`` is still the override's, and the error says it came from ``--set``."""
    with pytest.raises(archlab.SpecError) as caught:
        archlab.load_spec(ROOT / "specs" / "tiny" / "transformer.yaml", ["layout.layers.blocks.0.2x=1"])
    assert "layout.layers.blocks[0].2x: unknown key" in str(caught.value) and str(caught.value).endswith("(set in --set)")


@pytest.mark.parametrize("name,files,target,fragments", CASES, ids=[c[0] for c in CASES])
def test_malformed_spec_message(tmp_path, name, files, target, fragments):
    for fname, text in files.items():
        (tmp_path / fname).parent.mkdir(exist_ok=True)
        (tmp_path / fname).write_text(textwrap.dedent(text))
    with pytest.raises(archlab.SpecError) as caught:
        archlab.load_spec(tmp_path / target)
    message = str(caught.value)
    assert target in message
    for fragment in fragments:
        assert fragment in message, f"{fragment!r} missing from:\n{message}"
    if not any("(set in" in fragment for fragment in fragments):
        assert "(set in" not in message  # only a value from another file is traced to it
    assert "after validation" not in message  # a list whose one block is bad is not also called empty


def test_every_problem_is_reported_at_once(tmp_path):
    bad = BASE.replace("n_heads: 4", "n_heads: 5").replace("n_kv_heads: 2", "n_kv_heads: 3")
    (tmp_path / "s.yaml").write_text(bad)
    with pytest.raises(archlab.SpecError) as caught:
        archlab.load_spec(tmp_path / "s.yaml")
    assert len(caught.value.problems) == 2


def test_a_value_an_override_replaced_is_not_traced_to_the_file(tmp_path):
    (tmp_path / "base.yaml").write_text(STACK.replace("n_heads: 4}", "n_heads: 4, head_dim: 8}"))
    (tmp_path / "s.yaml").write_text("extends: base.yaml\nname: c\n")
    with pytest.raises(archlab.SpecError) as caught:  # head_dim is derived now (32 // 32): neither file set it
        archlab.load_spec(tmp_path / "s.yaml", ["layout.layers.blocks=[{type: attention, n_heads: 32}]"])
    assert "head_dim: RoPE needs an even head_dim, got 1" in str(caught.value) and "(set in" not in str(caught.value)
    with pytest.raises(archlab.SpecError) as caught:  # an inherited value overridden is the override's
        archlab.load_spec(tmp_path / "s.yaml", ["layout.layers.blocks.0.head_dim=7"])
    assert "got 7 (set in --set)" in str(caught.value)
    with pytest.raises(archlab.SpecError) as caught:  # an index written 00 is item 0: the override's, not base.yaml's
        archlab.load_spec(tmp_path / "s.yaml", ["layout.layers.blocks.00.head_dim=7"])
    assert "got 7 (set in --set)" in str(caught.value)


def test_an_override_inside_a_shorthand_sets_the_mapping_it_stands_for():
    """A shorthand is its mapping with the tag alone, as under ``extends``: an override of a field
    in it (or of its tag, which suggested a mapping with the tag twice) merges into that mapping,
    and a shorthand given over a mapping is a new tag, keeping the fields that kind also has."""
    spec = ROOT / "specs" / "tiny" / "yoco-u.yaml"  # its cross-decoder block and position are shorthands
    assert archlab.load_spec(spec, ["layout.cross_decoder.blocks.0.backend=flex"]).layout.cross_decoder.blocks[0].backend == "flex"
    rotated = archlab.load_spec(spec, ["layout.cross_decoder.position.type=rope", "layout.cross_decoder.position.theta=5e5"])
    assert rotated.layout.cross_decoder.position == archlab.spec.RoPE(type="rope", theta=5e5)
    with pytest.raises(archlab.SpecError) as caught:  # a plain string field is no shorthand
        archlab.load_spec(spec, ["name.x=1"])
    assert "name: is 'yoco-u', not a mapping or list" in str(caught.value)
    lower = archlab.load_spec(ROOT / "specs" / "tiny" / "upper-loop.yaml", ["loop=lower"])
    assert (lower.loop.position, lower.loop.times, lower.loop.kv_cache) == ("lower", 3, "shared")  # it said "times: Field required"
    assert archlab.load_spec(spec, ["norm.eps=0.1", "norm=layernorm"]).norm == archlab.spec.LayerNorm(type="layernorm", eps=0.1)


def test_an_override_inside_a_kind_left_at_its_default_sets_that_default(tmp_path):
    """It said "missing 'type'": the kind was not given, and the override's mapping stood alone."""
    (tmp_path / "s.yaml").write_text(BASE)  # no norm, ffn, loop, or position given
    spec = archlab.load_spec(tmp_path / "s.yaml", ["norm.eps=1e-5", "ffn.hidden=64", "layout.self_decoder.position.theta=500"])
    assert (spec.norm, spec.ffn) == (archlab.spec.RMSNorm(eps=1e-5), archlab.ffn.SwiGLU(hidden=64))
    assert spec.layout.self_decoder.position == archlab.spec.RoPE(type="rope", theta=500)
    with pytest.raises(archlab.SpecError) as caught:  # the cross-decoder's default is no position, which has no theta
        archlab.load_spec(tmp_path / "s.yaml", ["layout.cross_decoder.position.theta=500"])
    assert "layout.cross_decoder.position.theta: unknown key" in str(caught.value)


def test_a_mapping_without_its_kind_in_a_spec_is_its_defaults_kind(tmp_path):
    """As ``--set`` does above: ``norm: {eps: 0}`` said "missing 'type'", not what is wrong with eps.
    A mapping with a key its default's kind lacks still needs its kind said."""
    (tmp_path / "s.yaml").write_text(BASE + "norm: {eps: 1.0e-5}\nffn: {hidden: 64}\n")
    spec = archlab.load_spec(tmp_path / "s.yaml")
    assert (spec.norm, spec.ffn) == (archlab.spec.RMSNorm(eps=1e-5), archlab.ffn.SwiGLU(hidden=64))
    for given, said in (("norm: {eps: 0}", "norm.eps: Input should be greater than 0 (got 0)"),
                        ("loop: {times: 3}", "loop: missing 'position', which says what kind this is"),  # the default, none, has no times
                        ("ffn: {n_experts: 4}", "ffn: missing 'type', which says what kind this is (one of: swiglu, moe)"),
                        ("norm: {epsilon: 1.0e-5}", "norm.epsilon: unknown key")):  # a misspelt key, not a missing tag
        (tmp_path / "s.yaml").write_text(BASE + given + "\n")
        with pytest.raises(archlab.SpecError) as caught:
            archlab.load_spec(tmp_path / "s.yaml")
        assert said in str(caught.value), given


def test_a_whole_mapping_set_without_its_kind_keeps_the_kind_it_replaces(tmp_path):
    """Filled with the default's kind instead, ``norm={eps: 1e-6}`` turned a LayerNorm into an
    RMSNorm, and ``ffn={hidden: 256}`` an MoE into a SwiGLU, without a word (a study's ``set:``
    likewise). It keeps its kind, as ``extends`` merges a mapping, and fields that kind lacks are refused."""
    (tmp_path / "s.yaml").write_text(STACK + "norm: layernorm\nffn: {type: moe, n_experts: 4, top_k: 2, expert_hidden: 16}\n"
                                     "loop: {position: all, times: 2, kv_cache: shared}\n")
    spec = archlab.load_spec(tmp_path / "s.yaml", ["norm={eps: 1.0e-6}"])
    assert spec.norm == archlab.spec.LayerNorm(type="layernorm", eps=1e-6)
    for override, said in (("ffn={hidden: 256}", "ffn.hidden: unknown key"), ("loop={}", "loop.times: Field required")):
        with pytest.raises(archlab.SpecError) as caught:
            archlab.load_spec(tmp_path / "s.yaml", [override])
        assert said in str(caught.value), override


def test_overrides_may_be_a_mapping():
    """Values as given, not read as YAML; it was taken for a list of its keys, each said not to be
    a ``--set`` KEY=VALUE."""
    spec = ROOT / "specs" / "tiny" / "yoco-u.yaml"
    given = archlab.load_spec(spec, {"loop.times": 5, "layout.self_decoder.blocks.0.window": 8, "name": "1e3"})
    assert given == archlab.load_spec(spec, ["loop.times=5", "layout.self_decoder.blocks.0.window=8", "name='1e3'"])
    with pytest.raises(archlab.SpecError) as caught:
        archlab.load_spec(spec, {"loop.times": -1})
    assert "loop.times: Input should be greater than or equal to 1 (got -1) (set in overrides)" in str(caught.value)
    with pytest.raises(archlab.SpecError) as caught:
        archlab.load_spec(spec, {3: 1})
    assert "overrides: 1 problem(s)\n  3: a key is a dotted path" in str(caught.value)
    assert archlab.load_spec(spec, None) == archlab.load_spec(spec)  # None was iterated: a TypeError


@pytest.mark.parametrize("key", ["", " ", "loop..times", ".loop", "loop.times."])
def test_a_dotted_key_with_an_empty_name_in_it_is_refused_as_one(key):
    """"" was said to be an unknown key at "<root>", and "loop..times" one at "loop."."""
    with pytest.raises(archlab.SpecError) as caught:
        archlab.load_spec(ROOT / "specs/tiny/yoco-u.yaml", [f"{key}=2"] if key.strip() else {key: 2})
    assert f"{key!r}: a key is a dotted path of names (of keys, or a list's indices)" in str(caught.value), caught.value


def test_a_yes_or_no_in_a_list_of_numbers_is_refused_as_the_value_is():
    """YAML's no in ``betas: [no, 0.95]`` trained with a beta of 0.0."""
    with pytest.raises(archlab.SpecError) as caught:
        load_config(None, ["optimizer.betas=[0.9, no]"])
    assert "optimizer.betas[1]: got false, a yes/no value where a number is wanted" in str(caught.value)
    with pytest.raises(archlab.SpecError) as caught:
        load_config(None, ["optimizer.betas=[yes, no]", "optimizer.lr=-1"])
    assert str(caught.value).splitlines()[1:] == ["  optimizer.betas[0]: got true, a yes/no value where a number is wanted",
                                                   "  optimizer.betas[1]: got false, a yes/no value where a number is wanted",
                                                   "  optimizer.lr: Input should be greater than 0 (got -1)"]
    assert load_config(None, ["optimizer.betas=[0.9, 0.95]"]).optimizer.betas == (0.9, 0.95)


def test_an_override_that_would_replace_an_earlier_one_inside_it_is_refused():
    """The window set first was lost without a word when the whole block was set after it; the
    other order is how to say it."""
    spec, block = ROOT / "specs" / "tiny" / "yoco-u.yaml", "layout.self_decoder.blocks.0"
    whole, window = f"{block}={{type: swa, window: 4, n_heads: 4, n_kv_heads: 2}}", f"{block}.window=8"
    with pytest.raises(archlab.SpecError) as caught:
        archlab.load_spec(spec, [window, whole])
    assert f"replaces whole what {block}.window set inside it before; set {block} first" in str(caught.value)
    assert archlab.load_spec(spec, [whole, window]).layout.self_decoder.blocks[0].window == 8
    with pytest.raises(archlab.SpecError) as caught:  # the item spelt otherwise: the window was dropped without a word
        archlab.load_spec(spec, [window, f"{block}0.type=gdn"])
    assert f"{block}.type: is a kind without what {block}.window set before; set {block}.type first" in str(caught.value)
    with pytest.raises(archlab.SpecError) as caught:  # an unknown kind is named, not said to lack the window
        archlab.load_spec(spec, [window, f"{block}.type=swaa"])
    assert "unknown type 'swaa'" in str(caught.value) and "without what" not in str(caught.value)


def test_an_item_of_a_list_not_given_is_refused_with_the_whole_form(cli, tmp_path):
    """A list left to its default cannot be set an item at a time (it read as a mapping {0: ...})."""
    code, _, stderr = cli("train", ROOT / "specs" / "tiny" / "transformer.yaml", "--out", tmp_path / "run", "--steps", "1",
                          "--set", "optimizer.betas.0=0.8")
    assert code != 0 and not (tmp_path / "run").exists()
    assert "optimizer.betas: is not given, so its item 0 cannot be set alone: give it whole, as optimizer.betas=[...]" in stderr


@pytest.mark.parametrize("d_model,divisors,more", [
    (32, [1, 2, 4, 8, 16, 32], False),
    (720720, [h for h in range(1, 720721) if 720720 % h == 0][:12], True),
    (999999937, [1, 999999937], False),  # a prime
    (2**40, [2**i for i in range(12)], True),  # found by divisors up to the square root, not a loop over 10^12
    (36, [1, 2, 3, 4, 6, 9, 12, 18, 36], False),  # a square: its root, 6, is one
    (60, [1, 2, 3, 4, 5, 6, 10, 12, 15, 20, 30, 60], False),  # twelve: every one listed, none left out
])
def test_heads_that_do_not_tile_the_width_list_its_smallest_divisors(d_model, divisors, more):
    from archlab.block import Problems, check_heads

    problems = Problems()
    check_heads(problems, d_model, next(h for h in range(3, 100) if d_model % h), None)
    (problem,) = problems.found
    assert f"allowed: one of {divisors}{' ...' if more else ''}, or set head_dim explicitly" in problem.msg


@pytest.mark.parametrize("spec,changes,said", [
    # d_model=65 offered [1, 5, 13, 65]: with 2 K,V heads and RoPE, each of them failed again
    ("yoco-u.yaml", ["d_model=65"], "4 heads do not divide d_model=65; none that does suits this block, which needs n_heads a multiple"
                                    " of n_kv_heads=2: set head_dim explicitly"),  # 65's divisors are all odd
    ("yoco-u.yaml", ["d_model=66"], "4 heads do not divide d_model=66; none that does suits this block, which needs n_heads a multiple"
                                    " of n_kv_heads=2 and an even head size, for RoPE: set head_dim explicitly"),  # 2, 6, 22, 66: heads of 33, 11, 3, 1
    ("yoco-u.yaml", ["d_model=96", "layout.self_decoder.blocks.0.n_heads=5"],
     "allowed: one of [2, 4, 6, 8, 12, 16, 24, 48], or set head_dim explicitly"),  # 32 heads of 3 channels: odd
    ("yoco-u-gdn.yaml", ["d_model=96", "layout.self_decoder.blocks.0.n_heads=5", "layout.self_decoder.blocks.0.expand_v=1.5"],
     "allowed: one of [1, 2, 3, 4, 6, 8, 12, 16, 24, 48], or set head_dim explicitly"),  # 32 heads of 3: value heads of 4.5
])
def test_the_head_counts_offered_are_those_the_block_can_use(spec, changes, said):
    with pytest.raises(archlab.SpecError) as raised:
        archlab.load_spec(ROOT / "specs" / "tiny" / spec, changes)
    assert said in str(raised.value), raised.value


def test_heads_that_do_not_tile_the_width_are_allowed_with_their_head_dim_given():
    """The message's way out: with head_dim set, the heads need not divide d_model (3 heads of 16 in a width of 64)."""
    block = "layout.layers.blocks.0={type: attention, n_heads: 3, n_kv_heads: 1, head_dim: 16}"
    spec = archlab.load_spec(ROOT / "specs" / "tiny" / "transformer.yaml", [block])
    assert spec.layout.layers.blocks[0].shape(spec.d_model) == (3, 1, 16)
    with pytest.raises(archlab.SpecError, match="3 heads do not divide d_model=64"):
        archlab.load_spec(ROOT / "specs" / "tiny" / "transformer.yaml", [block.replace(", head_dim: 16", "")])


def test_a_spec_varied_past_its_checks_is_refused_by_the_build():
    """``model_copy(update=...)`` skips validation: a loop straddling the global K,V projection
    built as two loops, not the one the spec names."""
    spec = archlab.load_spec(ROOT / "specs" / "tiny" / "yoco-u.yaml")
    varied = spec.model_copy(update={"loop": spec.loop.model_copy(update={"position": "range", "start": 1, "end": 3})})
    with pytest.raises(archlab.SpecError, match="straddle the global K,V projection"):
        archlab.build_model(varied)


def loop_of(spec, **update):
    return spec.model_copy(update={"loop": spec.loop.model_copy(update=update)})


def self_decoder_of(spec, **update):
    half = spec.layout.self_decoder.model_copy(update=update)
    return spec.model_copy(update={"layout": spec.layout.model_copy(update={"self_decoder": half})})


@pytest.mark.parametrize("vary,said", [
    (lambda spec: loop_of(spec, times=0), "loop.times: Input should be greater than or equal to 1 (got 0)"),  # no self-decoder at all
    (lambda spec: spec.model_copy(update={"inference_dtype": "bf16"}), "inference_dtype: Input should be 'float32', 'bfloat16' or"),
    (lambda spec: self_decoder_of(spec, blocks=(spec.layout.self_decoder.blocks[0].model_copy(update={"window": 0}),)),
     "layout.self_decoder.blocks[0].window: Input should be greater than 0"),
    (lambda spec: spec.model_copy(update={"d_mdoel": 128}), "d_mdoel: unknown key"),
])
def test_a_spec_varied_by_model_copy_is_validated_again_by_the_build(vary, said):
    """Field limits skipped by ``model_copy(update=...)`` built a model that ran: a loop of 0 times
    dropped the self-decoder, a window of 0 ran its training pass; a misspelt key was ignored."""
    spec = archlab.load_spec(ROOT / "specs" / "tiny" / "yoco-u.yaml")
    with pytest.raises(archlab.SpecError) as raised:
        archlab.build_model(vary(spec))
    assert said in str(raised.value)
    assert archlab.build_model(loop_of(spec, times=2)).spec.loop.times == 2  # a valid variation builds as given


def test_a_half_varied_by_model_copy_works_out_its_position_again():
    """A half whose position was left out takes none where no block reads one (gdn); varied to a
    block that does (swa), it kept none and built attention without RoPE."""
    data = archlab.load_spec(ROOT / "specs" / "tiny" / "yoco-u-gdn.yaml").model_dump(mode="json", exclude_unset=True)
    del data["layout"]["self_decoder"]["position"]
    gdn = archlab.validate_spec(data)
    assert gdn.layout.self_decoder.position.type == "none"
    swa = archlab.load_spec(ROOT / "specs" / "tiny" / "yoco-u-swa.yaml").layout.self_decoder.blocks[0]
    assert archlab.build_model(self_decoder_of(gdn, blocks=(swa,))).spec.layout.self_decoder.position.type == "rope"


def test_extends_deep_merges_and_replaces_on_variant_change(tmp_path):
    cross = "cross_decoder: {n_layers: 2, position: none, blocks: [{type: cross_attention, n_heads: 2}]}"
    (tmp_path / "base.yaml").write_text(BASE.replace("cross_decoder: {n_layers: 2}", cross)
                                        + "ffn: {type: swiglu, hidden: 48}\nloop: {position: lower, times: 2}\n")
    (tmp_path / "child.yaml").write_text(
        "extends: base.yaml\nname: child\n"
        "layout: {self_decoder: {blocks: [{type: gdn, n_heads: 2}], position: none}, cross_decoder: {position: rope}}\n"
        "ffn: {type: moe, n_experts: 4, top_k: 2, expert_hidden: 16}\n"
        "loop: {times: 4}\n"
    )
    spec = archlab.load_spec(tmp_path / "child.yaml")
    assert spec.name == "child"
    assert spec.layout.self_decoder.n_layers == 2  # kept from the parent
    assert spec.layout.self_decoder.blocks[0].type == "gdn"  # lists replace
    assert spec.layout.self_decoder.position.type == "none"  # shorthand
    cross = spec.layout.cross_decoder  # a half's position is a field, not a tag: the rest of the half stays
    assert (cross.position.type, cross.n_layers, cross.blocks[0].n_heads) == ("rope", 2, 2)
    assert spec.ffn.type == "moe" and spec.ffn.n_experts == 4  # new variant: swiglu's hidden not merged in
    assert (spec.loop.position, spec.loop.times) == ("lower", 4)


def test_a_new_kind_keeps_the_fields_it_shares_and_a_shorthand_merges_as_its_mapping(tmp_path):
    """A child's new tag drops only the fields the new kind lacks; a shorthand in the parent merges
    with the child's mapping (it stood alone: "missing 'type'"). ``--set`` does as ``extends``."""
    (tmp_path / "base.yaml").write_text(STACK + "norm: layernorm\nloop: {position: all, times: 3, kv_cache: per_iteration}\n"
                                        + "ffn: {type: swiglu, hidden: 48}\n")
    (tmp_path / "child.yaml").write_text("extends: base.yaml\nname: child\nnorm: {eps: 1.0e-3}\n"
                                         "loop: {position: prefix, n_layers: 2}\n")
    spec = archlab.load_spec(tmp_path / "child.yaml")
    assert (spec.norm.type, spec.norm.eps) == ("layernorm", 1e-3)
    assert (spec.loop.position, spec.loop.n_layers, spec.loop.times, spec.loop.kv_cache) == ("prefix", 2, 3, "per_iteration")
    overridden = archlab.load_spec(tmp_path / "child.yaml", ["loop.position=range", "loop.start=1", "loop.end=3", "ffn.type=moe",
                                                             "ffn.n_experts=4", "ffn.top_k=2", "ffn.expert_hidden=16"])
    assert (overridden.loop.position, overridden.loop.start, overridden.loop.times) == ("range", 1, 3)
    assert (overridden.ffn.type, overridden.ffn.expert_hidden) == ("moe", 16)  # the SwiGLU's hidden did not follow
    with pytest.raises(archlab.SpecError) as caught:  # the other order would lose the start set first
        archlab.load_spec(tmp_path / "child.yaml", ["loop.position=range", "loop.start=1", "loop.end=3", "loop.position=all"])
    assert "loop.position: is a kind without what loop.start, loop.end set before; set loop.position first" in str(caught.value)
    assert archlab.load_spec(tmp_path / "child.yaml", ["norm.eps=0.1", "norm.type=rmsnorm"]).norm == archlab.spec.RMSNorm(eps=0.1)


@pytest.mark.parametrize("blocks,position", [("[gdn]", "none"), ("[mamba2, gdn]", "none"), ("[gdn, swa]", "rope")])
def test_a_half_left_without_position_has_rope_only_where_a_block_reads_it(tmp_path, blocks, position):
    (tmp_path / "s.yaml").write_text(STACK.replace("blocks: [{type: attention, n_heads: 4}]", f"blocks: {blocks}"))
    spec = archlab.load_spec(tmp_path / "s.yaml")
    assert spec.layout.layers.position.type == position
    assert (spec.build_context(0).rope_theta is None) == (position == "none")


@pytest.mark.parametrize("name", ["yoco-u-gdn", "yoco-u-mamba2"])
def test_a_rope_no_block_reads_still_loads_and_changes_nothing(name):
    """Runs saved before such a half's position defaulted to none wrote RoPE out: they load, and
    compute what none does, bit for bit."""
    import torch

    path = ROOT / "specs" / "tiny" / f"{name}.yaml"
    spec, rotated = archlab.load_spec(path), archlab.load_spec(path, ["layout.self_decoder.position=rope"])
    assert (spec.layout.self_decoder.position.type, rotated.layout.self_decoder.position.type) == ("none", "rope")
    model, again = archlab.build_model(spec), archlab.build_model(rotated)
    again.load_state_dict(model.state_dict())
    tokens = torch.randint(0, spec.vocab_size, (2, 24))
    torch.testing.assert_close(again(tokens), model(tokens), rtol=0, atol=0)


def test_show_output_is_a_valid_spec(tmp_path):
    from archlab.spec import spec_to_yaml

    (tmp_path / "s.yaml").write_text(BASE)
    original = archlab.load_spec(tmp_path / "s.yaml")
    text = spec_to_yaml(original)
    assert text.startswith("schema_version: 1\n")
    (tmp_path / "shown.yaml").write_text(text)
    assert archlab.load_spec(tmp_path / "shown.yaml") == original


@pytest.mark.parametrize("override,fragments", [
    ("seq_len=[", ["seq_len=[: the value is not YAML"]),
    ("seed=-1", ["seed:", "greater than or equal to 0"]),
    (f"seed={2**70}", ["seed:", "less than 9223372036854775808"]),
    ("optimizer.betas=[2, 0.9]", ["optimizer.betas[0]:", "less than 1"]),
    ("optimizer.betas=[.nan, .nan]", ["optimizer.betas[0]:", "optimizer.betas[1]:"]),
    ("steps=on", ["steps: got true, a yes/no value where a number is wanted"]),
    ("optimizer.betas=" + "[" * 3000 + "]" * 3000, ["the value is nested too deeply to read"]),  # a RecursionError traceback
    ("steps=1" + "0" * 5000, ["the value cannot be read: Exceeds the limit (4300 digits)"]),  # a ValueError traceback
    ("data.source='  '", ["data.source: is empty; give stdlib, a path"]),  # blank is empty, not a file named by spaces
    ("seq_len=1", ["seq_len: Input should be greater than or equal to 2"]),  # costed as a decoding step, not a training pass
    ('init="runs/a\\0b"', ["init: a path cannot hold a NUL byte"]),  # a ValueError traceback where a run was looked for
    ('data.cache=""', ["data.cache: is empty; give a path, or leave it out"]),  # the current folder, its tokenizer.json replaced
    ("data.tokenizer=' '", ["data.tokenizer: is empty; give a path, or leave it out"]),  # said "not a file" of the current folder
    ("data.source=hf::train", ["data.source: 'hf::train' names no dataset; give hf:NAME[:split]"]),  # "list index out of range"
], ids=["not yaml", "negative seed", "huge seed", "beta above 1", "nan betas", "on for a number", "nested past reading",
        "a number too long to read", "blank source", "one-token sequences", "NUL in a path", "blank cache", "blank tokenizer",
        "no dataset"])
def test_bad_training_config_override_is_named(override, fragments):
    with pytest.raises(archlab.SpecError) as caught:
        load_config(None, [override])
    message = str(caught.value)
    assert message.startswith("--set")
    for fragment in fragments:
        assert fragment in message, f"{fragment!r} missing from:\n{message}"


def test_a_micro_batch_that_does_not_divide_the_batch_is_refused_given_or_at_its_default():
    """A micro-batch size given that does not divide the batch is refused, even one larger than the
    batch; left at its default (16) it is refused only where the batch is larger and does not split
    into it, and said to be the default. The divisor offered is the largest below it, 1 for a prime batch."""

    for overrides, said, divisor in [
        (["batch_size=4", "micro_batch_size=6"], "micro_batch_size: 6 does not divide batch_size=4;", 4),
        (["batch_size=24"], "micro_batch_size: 16 (the default) does not divide batch_size=24;", 12),
        (["batch_size=7", "micro_batch_size=4"], "micro_batch_size: 4 does not divide batch_size=7;", 1),
    ]:
        with pytest.raises(archlab.SpecError) as caught:
            load_config(None, overrides)
        message = " ".join(str(caught.value).split())
        assert said in message and f"set micro_batch_size to a divisor, such as {divisor}" in message, message
    assert load_config(None, ["batch_size=4"]).micro_batch_size == 16  # passed whole: a pass takes at most the batch
    assert load_config(None, ["batch_size=32"]).micro_batch_size == 16


def test_a_batch_of_more_tokens_than_any_run_takes_is_refused_at_its_key():
    """batch_size=1e11 on a recall task built its rows one by one for minutes, its memory climbing to
    22 GB; on text it was said as a micro-batch that does not fit, and never named batch_size."""
    with pytest.raises(archlab.SpecError) as caught:
        load_config(None, ["batch_size=100000000000", "micro_batch_size=16", "seq_len=32"])
    assert ("batch_size: 100,000,000,000 sequences of seq_len=32 tokens are 3,200,000,000,000 tokens a step, more than the"
            " 268,435,456 (2^28) a step may take; check its units") in " ".join(str(caught.value).split())
    assert load_config(None, ["batch_size=65536", "micro_batch_size=16", "seq_len=4096"]).batch_size == 65536  # 2^28 tokens: taken


def test_a_yes_or_no_field_still_takes_yes():

    assert load_config(None, ["compile=yes"]).compile is True
    assert archlab.load_spec(ROOT / "specs" / "tiny" / "transformer.yaml", ["tie_embeddings=on"]).tie_embeddings is True


def test_an_moe_routing_to_more_experts_than_it_has_is_refused_and_to_all_of_them_is_not():
    """top_k is checked against n_experts only across the two fields, which no shipped spec comes near."""
    moe = ROOT / "specs" / "tiny" / "yoco-u-moe.yaml"
    assert archlab.load_spec(moe, ["ffn.top_k=8"]).ffn.top_k == 8
    with pytest.raises(archlab.SpecError) as caught:
        archlab.load_spec(moe, ["ffn.top_k=9"])
    assert [(p.loc, p.msg) for p in caught.value.problems] == [("ffn.top_k", "top_k=9 exceeds n_experts=8 (set in --set)")]


def test_an_override_of_a_list_item_one_past_its_end_is_named():
    """The last index of a two-block pattern is 1: index 2 is said as missing, not an IndexError."""
    from archlab.spec import set_dotted

    data = archlab.load_spec(ROOT / "specs" / "tiny" / "yoco-u-swa.yaml").model_dump(mode="json")
    blocks = data["layout"]["self_decoder"]["blocks"]
    last = len(blocks) - 1
    assert set_dotted(data, f"layout.self_decoder.blocks.{last}.type", "attention")["layout"]["self_decoder"]["blocks"][last]["type"] == "attention"
    with pytest.raises(archlab.SpecError, match=f"no item {last + 1} in a list of {len(blocks)}"):
        set_dotted(data, f"layout.self_decoder.blocks.{last + 1}.type", "attention")


def test_differences_show_floats_to_six_digits_and_a_missing_side_as_absent():
    """A learning rate changed in its fourth digit still reads as changed, not as x -> x."""
    from archlab.spec import describe_differences

    assert describe_differences({"optimizer": {"lr": 0.0012345}, "seed": 1}, {"optimizer": {"lr": 0.0012346}, "steps": 5}) == [
        "optimizer.lr 0.0012345 -> 0.0012346", "seed 1 -> (absent)", "steps (absent) -> 5"]


def test_cross_attention_given_its_heads_needs_no_global_head_dim_dividing_the_model(tmp_path):
    """Only query heads derived from d_model need it to be a multiple of the global K,V's head_dim;
    given n_heads, the queries' width (4 x 12 = 48 beside d_model 32) is the projections' own."""
    (tmp_path / "s.yaml").write_text(BASE.replace("head_dim: 8", "head_dim: 12").replace(
        "cross_decoder: {n_layers: 2}", "cross_decoder: {n_layers: 2, blocks: [{type: cross_attention, n_heads: 4}]}"))
    model = archlab.build_model(archlab.load_spec(tmp_path / "s.yaml"))
    cross = model.layers[2].mixer
    assert (cross.q_proj.out_features, cross.o_proj.in_features) == (48, 48)

