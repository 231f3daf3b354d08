#!/usr/bin/env python3
"""Write the main job's bundled long document (scripts/data/harbor-log.txt), deterministically.

A harbour master's log of ship arrivals, weather and cargo, one entry per day, with one fact that
the main job's question asks about (the code of the north warehouse) placed at about 40 % depth.
All text is generated here from small word lists: nothing is copied from elsewhere.

    .venv/bin/python scripts/make_long_document.py [-o scripts/data/harbor-log.txt] [--entries 640]
"""
from __future__ import annotations

import argparse
import random
from pathlib import Path

SHIPS = ["Albatross", "Bright Meadow", "Cormorant", "Dawn Treader", "Elsbeth", "Fair Wind", "Grey Heron",
         "Halcyon", "Iron Maiden", "Juniper", "Kestrel", "Lady Morgan", "Marigold", "North Star", "Osprey",
         "Pelican", "Quiet Harbour", "Red Fox", "Silver Birch", "Tern", "Union Jack", "Valiant", "Whimbrel"]
CARGO = ["timber", "salt cod", "wool bales", "barley", "coal", "copper ingots", "wine casks", "linen",
         "tea chests", "iron nails", "rope", "tar barrels", "oats", "slate", "apples", "pottery"]
WEATHER = ["a steady westerly breeze", "thick fog until noon", "light rain from the south", "clear skies",
           "a sharp northerly gale", "low cloud and drizzle", "calm water and sunshine", "squalls after dusk"]
CREW = ["the first mate", "the bosun", "a deckhand", "the cook", "the pilot", "the carpenter", "the purser"]
EVENTS = ["reported a loose plank on the east quay", "asked for fresh water and bread",
          "paid the harbour dues in silver", "waited two hours for the tide", "repaired a torn foresail",
          "traded news of the southern ports", "complained about the price of lamp oil",
          "unloaded in good order before sunset", "needed the crane for the heaviest crates",
          "left a letter for the customs office"]
FACT = "Note for all staff: the code for the north warehouse door is 4-7-2-9. Do not write it anywhere else."


def entry(rng: random.Random, day: int) -> str:
    ship, cargo = rng.choice(SHIPS), rng.choice(CARGO)
    tons = rng.randint(12, 480)
    lines = [f"Day {day}. Weather: {rng.choice(WEATHER)}.",
             f"The {ship} arrived at berth {rng.randint(1, 14)} carrying {tons} tons of {cargo}.",
             f"{rng.choice(CREW).capitalize()} of the {ship} {rng.choice(EVENTS)}."]
    if rng.random() < 0.5:
        other = rng.choice(SHIPS)
        lines.append(f"The {other} sailed on the evening tide with {rng.randint(5, 300)} tons of {rng.choice(CARGO)}.")
    return " ".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("-o", "--output", default=str(Path(__file__).resolve().parent / "data" / "harbor-log.txt"))
    ap.add_argument("--entries", type=int, default=640)
    ap.add_argument("--seed", type=int, default=1907)
    args = ap.parse_args()
    rng = random.Random(args.seed)
    entries = [entry(rng, day) for day in range(1, args.entries + 1)]
    entries.insert(int(len(entries) * 0.4), FACT)
    text = "Harbour master's log, Port of Wrenmouth.\n\n" + "\n".join(entries) + "\n"
    Path(args.output).write_text(text)
    print(f"wrote {args.output}: {len(text)} characters, {len(entries)} entries")


if __name__ == "__main__":
    main()
