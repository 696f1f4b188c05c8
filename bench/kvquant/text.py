"""The fixed text `bench kvquant` measures perplexity on: plain prose, written for this bench."""

TEXT = """\
The old stone bridge at the edge of the town was built more than three hundred years ago,
when the river was the only road that mattered. Farmers brought grain down to the mill on
flat boats, and merchants carried cloth and salt up to the villages in the hills. The bridge
changed all of that. For the first time a cart could cross the water in any season, and the
market moved from the riverbank to the square on the far side.

The men who built it had no engines and no steel. They cut the stone from a quarry two miles
upstream, floated the blocks down on rafts, and lifted them with wooden cranes worked by
hand. Each arch was raised on a frame of timber, called a centring, that held the stones in
place until the keystone was set. Only then could the frame be taken away, and only then did
the builders know whether the arch would stand. Most of them did. One, the third arch from
the north bank, fell twice before it held, and the town still tells the story of the mason
who slept under it for a week to prove that it was safe.

Over the centuries the bridge was repaired many times. A flood in the spring of a wet year
carried away part of the parapet, and the new stones are still a lighter grey than the old
ones. During a long war the bridge was nearly blown up by soldiers who wanted to slow the
enemy down; the charges were set, but the order to fire them never came, and the bridge
survived while newer bridges up and down the valley were destroyed. After the war the town
council argued for years about whether to widen it for motor traffic. In the end they built
a second bridge downstream for the lorries and kept the old one for people on foot.

Today children fish from the low wall on summer evenings, and tourists stop in the middle to
take pictures of the water and the church tower behind it. Few of them think about the weight
that the arches carry, or about the quiet arithmetic that keeps them standing. An arch works
because every stone pushes against its neighbours. The load travels around the curve and down
into the piers, and from the piers into the rock of the riverbed. As long as the line of that
thrust stays inside the stones, the arch is stable, whatever the traffic above it.

Engineers who study such bridges today use computers to trace that line, but the builders
worked from rules of thumb passed down from master to apprentice. The span of an arch should
not be more than a certain multiple of its thickness; the piers should be wide enough to stand
on their own if one arch were lost; the foundations should go down until the spade strikes
rock. These rules were not written in books. They were learned by watching, by failing, and
by remembering which bridges still stood after a hard winter and which did not.

There is a lesson in that for anyone who builds things that must last. Good design is often
less about clever ideas than about careful attention to what has worked before, and about
leaving enough margin for the loads that no one expected. The bridge has carried carts,
soldiers, cattle, bicycles and ambulances. Its builders could not have imagined most of them,
yet the stones they laid have held them all.
"""
