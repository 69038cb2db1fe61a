"""``profiling.sass_loops``: the loop finder and its counts on a hand-written SASS listing in
nvdisasm's format (labels on their own lines, ``/*addr*/`` before each instruction)."""

from __future__ import annotations

from profiling import sass_loops

SASS = """
        /*0000*/                   MOV R1, c[0x0][0x28] ;
.L_x_0:
        /*0010*/                   HMMA.16816.F32.BF16 R4, R8, R12, R4 ;
        /*0020*/                   FMNMX R2, R4, R5, !PT ;
        /*0030*/                   VOTE.ANY P0, !P0 ;
        /*0040*/              @!P0 BRA `(.L_x_1) ;
        /*0050*/                   FMUL R4, R4, R3 ;
        /*0060*/                   FMUL.FTZ R5, R5, R3 ;
.L_x_1:
        /*0070*/                   MUFU.EX2 R6, R2 ;
        /*0080*/              @P1 BRA `(.L_x_0) ;
        /*0090*/                   EXIT ;
.L_x_2:
        /*00a0*/                   BRA `(.L_x_2) ;
"""


def test_parse_and_opcode():
    instrs, labels = sass_loops.parse(SASS)
    assert len(instrs) == 11 and labels == {".L_x_0": 0x10, ".L_x_1": 0x70, ".L_x_2": 0xA0}
    assert sass_loops.opcode("@!P0 FMUL.FTZ R5, R5, R3") == "FMUL"
    assert sass_loops.opcode("HMMA.16816.F32.BF16 R4, R8, R12, R4") == "HMMA"


def test_the_loop_and_its_skippable_block():
    (main,) = sass_loops.loops(SASS)  # the kernel's closing self-branch is not a loop
    assert (main.start, main.end, main.size) == (0x10, 0x80, 8)
    assert main.ops == {"HMMA": 1, "FMNMX": 1, "VOTE": 1, "BRA": 2, "FMUL": 2, "MUFU": 1}
    assert main.skippable == 2  # the two FMULs the vote's branch jumps over
