"""The groups' sums added in the canonical tree across devices.

:mod:`.program` builds the combine program (the groups' blocks -> the total on every
group); :mod:`.pairwise` is its fast path: the tree's top levels as reduce-scatters of
two devices, checked on the devices before use.
"""
