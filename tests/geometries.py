"""Problem geometries that several test files share (the sanitizer runs reuse the forced
variants' ones), and the API grid: op x rank x data layout x weights format x dtype.
"""

from __future__ import annotations

import itertools

from cases import DTYPES, TRANSPOSE

from convgrad.reference import OP_KINDS

# Per rank: stride and dilation above 1 somewhere, asymmetric pads.
GEOMETRY = {
    1: dict(spatial=(9,), kernel=(3,), attrs=dict(strides=2, dilations=2, pads_begin=[2],
                                                   pads_end=[1])),
    2: dict(spatial=(7, 6), kernel=(3, 2), attrs=dict(strides=[2, 1], dilations=[1, 2],
                                                       pads_begin=[1, 0], pads_end=[0, 2])),
    3: dict(spatial=(4, 5, 3), kernel=(2, 3, 2),
            attrs=dict(strides=[1, 2, 1], dilations=[2, 1, 1], pads_begin=[1, 2, 0],
                       pads_end=[0, 1, 1])),
}


def weights_formats(op):
    return ("IOX", "XOI", "IXO") if op in TRANSPOSE else ("OIX", "XIO", "OXI")


# Each (op, layout, dtype) runs the three weights formats, one on each rank.
GRID = [(op, rank, df, weights_formats(op)[(rank + i) % 3], dt)
        for op, rank, df, (i, dt) in
        itertools.product(OP_KINDS, (1, 2, 3), ("NXC", "NCX"), enumerate(DTYPES))]


ALL_TAPS_GEOMETRY = {
    # 3x3, a channel tail (avx512: 5 vectors, blocks of 2 and a last 1), pads on one side
    "3x3": dict(spatial=(9, 23), kernel=(3, 3), in_channels=72, out_channels=72, groups=72,
                batch=2, attrs=dict(pads_begin=[1, 1], pads_end=[0, 1])),
    # strides and dilation: columns some w taps never reach, rows some h taps skip
    "strided": dict(spatial=(11, 17), kernel=(3, 2), in_channels=40, out_channels=40,
                    groups=40, batch=1,
                    attrs=dict(strides=[2, 3], dilations=[2, 1], pads_begin=[2, 0],
                               pads_end=[1, 1])),
    # 3-D: one register tile per kd; 1-D: a single h tap
    "3d": dict(spatial=(4, 5, 9), kernel=(2, 3, 3), in_channels=24, out_channels=24,
               groups=24, batch=2, attrs=dict(pads_begin=1, pads_end=[0, 1, 1])),
    "1d": dict(spatial=(50,), kernel=(5,), in_channels=33, out_channels=33, groups=33,
               batch=3, attrs=dict(dilations=[2], pads_begin=[4], pads_end=[3])),
}


STREAM_GEOMETRY = {
    # stride 2 with pads: 1, 2 or 4 taps per pixel; 48 channels, a last vector block of
    # 2 on avx2 (4 + 2), 3 single-vector blocks on avx512
    "strided": dict(spatial=(9, 13), kernel=(3, 3), in_channels=48, out_channels=48,
                    groups=48, attrs=dict(strides=[2, 2], pads_begin=[1, 1],
                                          pads_end=[1, 0])),
    # stride 1 along w: the sliding tiles' runs, which tiles take where the result streams
    "sliding": dict(spatial=(5, 30), kernel=(2, 3), in_channels=32, out_channels=32,
                    groups=32, attrs=dict(dilations=[1, 2], pads_begin=[1, 2],
                                          pads_end=[0, 1])),
    # 3-D, one line of channels
    "3d": dict(spatial=(3, 4, 5), kernel=(2, 3, 3), in_channels=16, out_channels=16,
               groups=16, attrs=dict(strides=[1, 2, 1], pads_begin=1, pads_end=[0, 1, 1])),
    # enough multiply-adds for 2 threads (MIN_THREAD_FLOPS): each streams its rows
    "threads": dict(spatial=(24, 40), kernel=(3, 3), in_channels=128, out_channels=128,
                    groups=128, attrs=dict(pads_begin=1, pads_end=1)),
    # across groups, 2 channels per group spread to the lanes
    "groups": dict(spatial=(6, 9), kernel=(3, 3), in_channels=16, out_channels=16, groups=8,
                   attrs=dict(pads_begin=1, pads_end=1)),
}


NCX_WEIGHT_GEOMETRY = {
    # 1x1 stride 1 without pads: each image's pixels are one run of every channel
    "pointwise": dict(spatial=(5, 7), kernel=(1, 1), batch=3, groups=1),
    # runs of one row each, cut by pads; stride, dilation, groups, rows no tap reads
    "strided": dict(spatial=(9, 8), kernel=(3, 2), batch=2, groups=2,
                    attrs=dict(strides=[3, 1], dilations=[1, 2], pads_begin=[1, 2],
                               pads_end=[0, 1])),
    # 1-D with a kernel wider than the image's pads: runs that merge across images do not
    "1d": dict(spatial=(11,), kernel=(4,), batch=3, groups=1,
               attrs=dict(pads_begin=[2], pads_end=[1])),
}


DOT_WEIGHT_GEOMETRY = {
    # 1x1: runs merge across rows; 3 chunks, 3 superblocks, input-channel tails
    "1x1": dict(spatial=(20, 26), kernel=(1, 1), in_channels=301, out_channels=46, batch=2),
    # taps, pads, dilation along w, stride along h, groups, output-channel tail
    "3x3": dict(spatial=(9, 13), kernel=(3, 3), in_channels=20, out_channels=26, groups=2,
                batch=2, attrs=dict(strides=[2, 1], dilations=[1, 2], pads_begin=[1, 2],
                                    pads_end=[0, 1])),
    # 1-D with pads and runs shorter than a vector; 3-D
    "1d": dict(spatial=(11,), kernel=(4,), in_channels=9, out_channels=7, batch=3,
               attrs=dict(pads_begin=[2], pads_end=[1])),
    "3d": dict(spatial=(4, 5, 6), kernel=(1, 2, 2), in_channels=12, out_channels=5, batch=2,
               attrs=dict(strides=[2, 1, 1], pads_begin=[0, 1, 0], pads_end=[1, 0, 1])),
}


IMAGE_BLOCK_GEOMETRY = {
    # 3x3 with pads on rows narrow enough to be padded (the padded copy per block)
    "3x3 padded": dict(spatial=(30, 13), kernel=(3, 3), in_channels=5, out_channels=7,
                       attrs=dict(pads_begin=1, pads_end=1)),
    # strides and dilation: phases of the data gradient; rows too wide to pad
    "strided": dict(spatial=(27, 40), kernel=(3, 2), in_channels=3, out_channels=6,
                    attrs=dict(strides=[2, 3], dilations=[2, 1], pads_begin=[1, 0],
                               pads_end=[2, 1])),
    # strided 1x1 (ResNet's projection shortcuts), 1-D and 3-D
    "1x1 strided": dict(spatial=(24, 22), kernel=(1, 1), in_channels=9, out_channels=20,
                        attrs=dict(strides=[2, 2])),
    "1d": dict(spatial=(700,), kernel=(5,), in_channels=6, out_channels=4,
               attrs=dict(pads_begin=[2], pads_end=[2])),
    "3d": dict(spatial=(6, 11, 12), kernel=(3, 1, 3), in_channels=4, out_channels=5,
               attrs=dict(pads_begin=[1, 0, 1], pads_end=[1, 0, 1])),
}


BF16_PAIR_GEOMETRY = {
    # rows of 45 pixels (19-21 pairs inside), pads and a dilation move the pairs' first
    # pixel by kw; 37 and 35 channels: two blocks of 16 and a tail
    "3x3": dict(spatial=(3, 45), kernel=(3, 3), in_channels=37, out_channels=35,
                attrs=dict(dilations=[1, 2], pads_begin=[1, 1], pads_end=[1, 2])),
    # two groups of 24 input channels, an odd width (a last pixel without partner)
    "1x1 groups": dict(spatial=(2, 71), kernel=(1, 1), in_channels=48, out_channels=40,
                       groups=2),
    "1d": dict(spatial=(100,), kernel=(5,), in_channels=16, out_channels=17,
               attrs=dict(pads_begin=[2], pads_end=[3])),
    # even widths: diff_dst rows go VL at a time as one row (19 rows of 14 pixels: a run
    # of 16 and one of 3; 5 rows of 6: one run shorter than a transpose; 3-D: runs over
    # depth and height), with output channel tails
    "1x1 even rows": dict(spatial=(19, 14), kernel=(1, 1), in_channels=20, out_channels=35),
    "3x3 even rows": dict(spatial=(5, 6), kernel=(3, 3), in_channels=18, out_channels=20,
                          attrs=dict(pads_begin=1, pads_end=1)),
    "3d even rows": dict(spatial=(3, 7, 8), kernel=(2, 1, 3), in_channels=8, out_channels=33,
                         groups=1, attrs=dict(pads_begin=[1, 0, 1], pads_end=[0, 0, 1])),
}


BF16_CHANNEL_PAIR_GEOMETRY = {
    # 63 pixels: one block of 32 and a tail of 31; 40 reduced channels: two vectors of 16
    # and a tail of 8 (the 1x1 layers of ResNet-50 in miniature)
    "1x1": dict(spatial=(7, 9), kernel=(1, 1), in_channels=24, out_channels=40),
    # exactly two blocks of 32 pixels and two vectors of channels: no tails
    "1x1 whole blocks": dict(spatial=(8, 8), kernel=(1, 1), in_channels=16, out_channels=32),
    # two groups of 18 reduced channels each: the pairs are still the channels-last input
    "3x3 groups": dict(spatial=(5, 13), kernel=(3, 3), in_channels=20, out_channels=36,
                       groups=2, attrs=dict(pads_begin=1, pads_end=[0, 2])),
    # 5 reduced channels per group: a zero partner ends each group, so value by value
    "odd groups": dict(spatial=(6, 11), kernel=(1, 3), in_channels=9, out_channels=15,
                       groups=3, attrs=dict(pads_begin=[0, 1], pads_end=[0, 1])),
}


PACKED_WEIGHT_GEOMETRY = {
    # taps, stride, dilation, groups, pads; about 2 chunks per image
    "3x3": dict(spatial=(14, 11), kernel=(3, 3), in_channels=124, out_channels=124, groups=2,
                batch=2, attrs=dict(strides=[2, 1], dilations=[1, 2], pads_begin=[1, 2],
                                    pads_end=[0, 1])),
    # rows two apart in h: each output row's src rows packed once, two slots apart;
    # chunks of 14 rows over planes of 13
    "3x3 dilated rows": dict(spatial=(17, 9), kernel=(3, 3), in_channels=20, out_channels=24,
                             batch=2, attrs=dict(dilations=[2, 1], pads_begin=[1, 1],
                                                 pads_end=[1, 0])),
    # 1-wide kernel with strides: panels hold only the columns outputs read; pads
    "1x1 strided": dict(spatial=(9, 11), kernel=(1, 1), in_channels=260, out_channels=300,
                        batch=2, attrs=dict(strides=[2, 3], pads_begin=[1, 1],
                                            pads_end=[0, 1])),
    # 1x1 stride 1: channels-last pixels regrouped into long rows, runs that merge
    "pointwise": dict(spatial=(15, 21), kernel=(1, 1), in_channels=260, out_channels=270,
                      batch=2),
    "1d": dict(spatial=(150,), kernel=(3,), in_channels=100, out_channels=98, batch=2,
               attrs=dict(strides=[2], pads_begin=[2], pads_end=[0])),
    "3d": dict(spatial=(5, 6, 7), kernel=(3, 3, 3), in_channels=64, out_channels=48, batch=1,
               attrs=dict(pads_begin=1, pads_end=1)),
    # 16 input channels per group: tiles of near-equal height (8 + 8 on avx512, 4 x 4 on
    # avx2) over 2 output vectors
    "3d grouped": dict(spatial=(4, 5, 6), kernel=(3, 3, 3), in_channels=32, out_channels=64,
                       groups=2, batch=1, attrs=dict(pads_begin=1, pads_end=[0, 1, 1])),
}


SLICED_WEIGHT_GEOMETRY = {
    # 1x1: read in place (channels-last f32 on avx512) or from packed panels
    "1x1": dict(spatial=(32, 33), kernel=(1, 1), in_channels=150, out_channels=40, batch=4),
    # 3x3 with groups, pads, stride in h: packed panels, rows cut into slices
    "3x3": dict(spatial=(132, 32), kernel=(3, 3), in_channels=24, out_channels=34, groups=2,
                batch=2, attrs=dict(strides=[2, 1], pads_begin=1, pads_end=[0, 1])),
}


GROUP_LANES_GEOMETRY = {
    # 2 in x 2 out per group, a partial vector, stride, dilation, asymmetric pads
    "2x2 strided": dict(spatial=(13, 11), kernel=(3, 3), in_channels=6, out_channels=6,
                        groups=3, batch=2, attrs=dict(strides=[2, 1], dilations=[1, 2],
                                                      pads_begin=[1, 2], pads_end=[0, 1])),
    # 4 x 4 over 3 vectors (avx2): several vector blocks; rows narrower than the kernel
    "4x4 3d": dict(spatial=(4, 5, 3), kernel=(3, 3, 3), in_channels=24, out_channels=24,
                   groups=6, batch=2, attrs=dict(pads_begin=1, pads_end=[0, 1, 1])),
    # groups that straddle vectors: 3 in, 2 out; outputs in blocks with a last block
    "3x2 1d": dict(spatial=(40,), kernel=(5,), in_channels=27, out_channels=18, groups=9,
                   batch=3, attrs=dict(strides=[3], pads_begin=[2], pads_end=[1])),
    # 1x1, 2 in x 4 out (ResNeXt-style bottleneck widths, fewer)
    "2x4 1x1": dict(spatial=(9, 7), kernel=(1, 1), in_channels=10, out_channels=20, groups=5,
                    batch=2),
    # 6 outputs per group: two output blocks on avx2
    "1x6": dict(spatial=(6, 9), kernel=(3, 3), in_channels=4, out_channels=24, groups=4,
                batch=2, attrs=dict(pads_begin=1, pads_end=1)),
}


COL2IM_GEOMETRY = {
    # conv1 of an image network: 7x7 stride 2, pads; columns of 49 taps x 3 channels
    "conv1": dict(spatial=(9, 11), kernel=(7, 7), in_channels=3, out_channels=8, batch=2,
                  attrs=dict(strides=[2, 2], pads_begin=[3, 3], pads_end=[2, 3])),
    # dilation along w (a tap's channels one at a time), stride 3, rows no tap reaches;
    # more than PARTIAL_PRODUCTS reduced channels (two partial sums per column)
    "1d": dict(spatial=(7,), kernel=(5,), in_channels=2, out_channels=130, batch=3,
               attrs=dict(strides=[3], dilations=[2], pads_begin=[4], pads_end=[3])),
    # result channels over more than one vector (a partial last one) on 8 and 4 lanes
    "3x3": dict(spatial=(6, 5), kernel=(3, 3), in_channels=12, out_channels=9, batch=2,
                attrs=dict(pads_begin=[1, 1], pads_end=[1, 0])),
    # 3-D, one result channel, stride and dilation along d, one image over 2 threads
    "3d": dict(spatial=(3, 4, 5), kernel=(2, 3, 3), in_channels=1, out_channels=5, batch=1,
               attrs=dict(strides=[2, 1, 1], dilations=[2, 1, 1], pads_begin=[1, 1, 0],
                          pads_end=[0, 1, 2])),
}


SWAPPED = dict(spatial=(5, 7), kernel=(1, 1), in_channels=20, out_channels=37, batch=3,
               data_format="NCX")
