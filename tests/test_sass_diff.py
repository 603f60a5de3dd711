"""tools/sass_diff.py: two trees' kernels compared instruction by instruction (no GPU)."""

import pathlib

import pytest

from tests.tool_loader import load_tool

TOOL = pathlib.Path(__file__).resolve().parents[1] / "tools" / "sass_diff.py"

LISTING = """
\t.headerflags\t@"EF_CUDA_SM90 EF_CUDA_VIRTUAL_SM(EF_CUDA_SM90)"
//--------------------- .text._Z1aPf --------------------------
.text._Z1aPf:
        /*0000*/                   LDC R1, c[0x0][0x28] ;
        /*0010*/               @P0 BRA `(.L_x_3) ;
.L_x_3:
        /*0020*/                   EXIT ;
//--------------------- .text._Z1bPf --------------------------
.text._Z1bPf:
        /*0000*/                   IMAD.MOV.U32 R2, RZ, RZ, R3 ;
        /*0010*/                   EXIT ;
"""


def test_functions_read_each_kernel_without_addresses_or_label_numbers():
    """functions: a kernel's instructions in order, addresses dropped, branch labels as L (they
    are numbered per cubin, so two builds of the same code differ only there)."""
    tool = load_tool("sass_diff")
    kernels = tool.functions(LISTING)
    assert kernels == {
        "_Z1aPf": ["LDC R1, c[0x0][0x28]", "@P0 BRA `(L)", "EXIT"],
        "_Z1bPf": ["IMAD.MOV.U32 R2, RZ, RZ, R3", "EXIT"],
    }
    renumbered = LISTING.replace(".L_x_3", ".L_x_41")
    assert tool.functions(renumbered) == kernels


def test_compare_sorts_kernels_into_same_differ_and_one_sided():
    """compare: identical kernels, kernels whose instructions differ (with both counts), and
    kernels only one tree has."""
    tool = load_tool("sass_diff")
    old = {"k<1>": ["A", "B"], "k<2>": ["A"], "gone<>": ["X"]}
    new = {"k<1>": ["A", "B"], "k<2>": ["A", "C"], "added<>": ["Y"]}
    assert tool.compare(old, new) == (["k<1>"], [("k<2>", 1, 2)], ["gone<>"], ["added<>"])


def test_a_tree_against_itself_is_identical(capsys):
    """The whole path (NVRTC to PTX in the tree's own process, ptxas, nvdisasm) on two kernels of
    this checkout against itself: identical, exit 0. Skipped where a tool is missing."""
    pytest.importorskip("cupy_backends.cuda.libs.nvrtc", reason="needs CuPy's NVRTC")
    tool = load_tool("sass_diff")
    if tool.find_tool("ptxas") is None or tool.find_tool("nvdisasm") is None:
        pytest.skip("needs ptxas and nvdisasm (pip install nvidia-cuda-nvdisasm)")
    root = str(TOOL.parents[1])
    match = ["qk_rope<__half, true, 8, int>"]
    code = tool.main([root, "--new", root, "--stem", "qk_rope", "--match", *match])
    out = capsys.readouterr().out
    assert code == 0, out
    assert out.strip().endswith("identical, 0 differ of 1 (sm_90)"), out


def test_missing_tools_are_named(monkeypatch):
    """Without ptxas the tool stops with a message that names it (and how to get it)."""
    tool = load_tool("sass_diff")
    monkeypatch.setattr(tool, "find_tool", lambda name: None)
    with pytest.raises(SystemExit, match="ptxas not found"):
        tool.main([".", "--stem", "qk_rope"])
