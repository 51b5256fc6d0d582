"""sg.manual_seed: one seed for every generator symgrad draws from, as torch.manual_seed.

Above both generators it seeds: the NumPy one behind parameters' initial values
(symgrad.api.sources) and the counter-based one behind dropout (symgrad.api.random, which builds its
state variables with symgrad.api.sources).
"""

from __future__ import annotations

from . import random as graph_random
from . import sources


def manual_seed(seed: int) -> None:
    """Seed every generator symgrad draws from, as torch.manual_seed does.

    That is the one behind init="normal" / "uniform" (and nn layers'
    initialisation), and the default dropout generator of layers built
    afterwards (symgrad.api.random).
    """
    sources.seed_host_generator(seed)
    graph_random.manual_seed(seed)
