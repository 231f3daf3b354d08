"""Filler text for the synthetic evaluation tasks: plain sentences of our own about an ordinary day.

Why our own: the head trainer learns from Python's documentation (``pydoc_data``), so evaluating on that
text would test the heads on what they were trained on. These sentences are deliberately bland and
carry nothing a task asks about: no digits, no names, no capitalised codes, no words the tasks use for
keys, so every needle is the only place its answer occurs. They are shuffled per sample
(haystack.sentence_stream), so the long text is not one short loop repeated.
"""
from __future__ import annotations

SENTENCES = (
    "The morning light came slowly over the hills and settled on the roofs of the village.",
    "A farmer walked his dog along the edge of the field before the dew had dried.",
    "In the bakery the first loaves were cooling on wooden racks near the window.",
    "Somebody had left a bicycle leaning against the fence by the old stone bridge.",
    "The river ran quietly under the willows, carrying a few leaves toward the mill.",
    "At the market the stalls were covered with apples, pears and heavy cabbages.",
    "Two neighbours stopped to talk about the weather and whether it would rain by evening.",
    "A cat slept on a warm windowsill and ignored the pigeons on the square below.",
    "The schoolchildren hurried past the post office, their bags bouncing on their backs.",
    "Clouds gathered in the west, but the sun still shone on the church tower.",
    "In the garden behind the inn, rows of beans climbed their poles toward the light.",
    "The ferry left the landing on time and crossed the wide lake without hurry.",
    "An old man repaired a chair in his workshop, humming a tune he had always known.",
    "The smell of fresh coffee drifted out of the kitchen and into the narrow lane.",
    "A gust of wind rattled the shutters and sent dry leaves skittering across the yard.",
    "By noon the square was full of people buying bread, cheese and flowers.",
    "The librarian sorted returned books onto a trolley and wheeled it between the shelves.",
    "A train whistled somewhere beyond the forest, and the sound faded into the valley.",
    "Children built a small dam of pebbles where the stream widened near the meadow.",
    "The painter set up her easel on the hill and studied the shape of the distant coast.",
    "Rain began softly in the afternoon and the streets turned dark and shiny.",
    "A delivery van stopped outside the hardware shop and unloaded crates of nails and rope.",
    "The baker's daughter counted coins into the till and wrote the sales in a ledger.",
    "Swallows flew low over the pond, which usually means the weather is about to change.",
    "The old clock in the hall struck the hour, a little late as it always was.",
    "Someone was practising the piano in an upstairs room with the window open.",
    "On the road out of town a tractor moved slowly, and the cars waited patiently behind it.",
    "The shepherd brought the flock down from the upper pasture before the fog rolled in.",
    "Evening came and the lamps along the harbour were lit one after another.",
    "A fisherman mended his nets on the quay while gulls watched from the mooring posts.",
    "The soup simmered on the stove, and the whole house smelled of onions and thyme.",
    "Snow had fallen in the night, and the footprints of a fox crossed the white lawn.",
    "The carpenter measured the doorway twice before he cut the new frame.",
    "Along the canal, a narrow boat moved past the locks with its engine barely turning.",
    "In the orchard the pickers filled their baskets and carried them to the cart.",
    "A kettle whistled in the kitchen, and someone took it off the heat just in time.",
    "The wind dropped at dusk and the lake became as smooth as a sheet of glass.",
    "An owl called from the barn roof as the last light left the sky.",
    "The tailor pinned the hem of a coat and stepped back to judge the length.",
    "Bees worked through the lavender beside the path, heavy with pollen.",
    "A small crowd gathered to watch the street musician play an accordion by the fountain.",
    "The doctor's car went up the lane toward the farm at the top of the hill.",
    "Washing hung on a line between two apple trees and flapped in the breeze.",
    "The grocer stacked oranges into a neat pyramid and polished the top one with his sleeve.",
    "Mist lay in the hollows of the valley long after the sun had risen above the ridge.",
    "Lanterns swung above the doors of the inn, and laughter came from inside.",
    "The potter shaped a bowl on her wheel and set it carefully on the shelf to dry.",
    "Ducks paddled in a line across the millpond and disappeared among the reeds.",
    "A letter arrived for the schoolteacher, and she read it standing at the gate.",
    "Toward night the stars came out one by one over the quiet fields.",
)
