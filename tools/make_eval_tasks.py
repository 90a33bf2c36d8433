"""Write the default evaluation tasks' data files (pipeline/eval/tasks/*.jsonl) from the items below.

The items are the project's own: short factual and commonsense questions, each with one right answer and three
wrong ones, written for a small model to have a fair chance (SmolLM2-135M scores well above the 25% of chance).
The answer's position among the choices is drawn from a seeded generator, so the files are reproducible:

    python tools/make_eval_tasks.py          # rewrites the .jsonl files; commit them with any change here
"""
from __future__ import annotations

import json
import random
from pathlib import Path

OUT = Path(__file__).resolve().parents[1] / "pipeline" / "eval" / "tasks"

# question | right answer | three wrong answers
FACTS = """
What is the capital of France?|Paris|London|Berlin|Madrid
What is the capital of Italy?|Rome|Paris|Vienna|Lisbon
What is the capital of Japan?|Tokyo|Beijing|Seoul|Bangkok
What is the capital of Germany?|Berlin|Munich|Vienna|Zurich
What is the capital of Spain?|Madrid|Barcelona|Lisbon|Rome
What is the capital of England?|London|Dublin|Paris|Edinburgh
What is the capital of Russia?|Moscow|Kiev|Warsaw|Prague
What is the capital of China?|Beijing|Tokyo|Shanghai|Hong Kong
What is the capital of Egypt?|Cairo|Nairobi|Tunis|Baghdad
What is the capital of Greece?|Athens|Rome|Istanbul|Sofia
What is the capital of Canada?|Ottawa|Toronto|Vancouver|Chicago
What is the capital of the United States?|Washington|New York|Chicago|Boston
What is the capital of Portugal?|Lisbon|Madrid|Porto|Seville
What is the capital of Ireland?|Dublin|Belfast|London|Glasgow
What is the capital of Austria?|Vienna|Berlin|Budapest|Prague
What is the capital of Norway?|Oslo|Stockholm|Helsinki|Copenhagen
What is the capital of Sweden?|Stockholm|Oslo|Helsinki|Riga
What is the capital of India?|New Delhi|Mumbai|Karachi|Dhaka
What is the capital of Mexico?|Mexico City|Lima|Bogota|Havana
What is the capital of Argentina?|Buenos Aires|Santiago|Lima|Montevideo
Which animal says "moo"?|cow|dog|cat|duck
Which animal says "woof"?|dog|cow|sheep|horse
Which animal says "meow"?|cat|dog|pig|goat
Which animal says "quack"?|duck|cow|cat|lion
Which animal has a very long neck?|giraffe|rabbit|mouse|penguin
Which animal is known as the king of the jungle?|lion|mouse|sheep|frog
Which animal has a trunk?|elephant|tiger|horse|rabbit
Which animal can fly?|bird|fish|dog|snake
Which animal lives in water and has fins?|fish|cat|horse|cow
Which animal gives us wool?|sheep|dog|fish|chicken
Which animal lays eggs that people eat for breakfast?|chicken|cow|dog|cat
Which insect makes honey?|bee|ant|fly|spider
What is a baby dog called?|puppy|kitten|calf|chick
What is a baby cat called?|kitten|puppy|lamb|foal
What is the opposite of hot?|cold|warm|big|fast
What is the opposite of up?|down|left|over|high
What is the opposite of big?|small|large|tall|wide
What is the opposite of day?|night|morning|sun|week
What is the opposite of happy?|sad|glad|funny|kind
What is the opposite of fast?|slow|quick|loud|hard
What is the opposite of open?|closed|wide|empty|free
What is the opposite of wet?|dry|cold|soft|damp
What is the opposite of old?|young|ancient|tall|slow
What is the opposite of full?|empty|heavy|large|whole
What is the opposite of light?|dark|bright|white|sunny
What is the opposite of left?|right|west|back|down
What is the opposite of black?|white|dark|grey|brown
What is the opposite of yes?|no|maybe|sure|okay
What is the opposite of in?|out|inside|into|within
What is the opposite of early?|late|soon|first|quick
What color is the sky on a clear day?|blue|green|red|black
What color is grass?|green|blue|purple|orange
What color is a ripe banana?|yellow|blue|black|purple
What color is snow?|white|black|green|red
What color is coal?|black|white|yellow|pink
What color is blood?|red|blue|green|yellow
What color are most oranges?|orange|blue|purple|grey
What color do you get by mixing blue and yellow?|green|red|pink|brown
What color is a stop sign?|red|blue|green|purple
How many legs does a dog have?|four|two|six|eight
How many legs does a spider have?|eight|four|six|ten
How many legs does a bird have?|two|four|six|three
How many days are in a week?|seven|five|ten|twelve
How many months are in a year?|twelve|ten|seven|thirty
How many hours are in a day?|twenty-four|twelve|sixty|ten
How many minutes are in an hour?|sixty|twenty|one hundred|twelve
How many wheels does a bicycle have?|two|three|four|six
How many sides does a triangle have?|three|four|five|six
How many sides does a square have?|four|three|five|eight
How many fingers are on one hand?|five|four|six|ten
What is two plus two?|four|three|five|six
What is ten minus one?|nine|eleven|ten|eight
What is three times three?|nine|six|twelve|three
What is half of ten?|five|two|twenty|four
Which day comes after Monday?|Tuesday|Sunday|Friday|Thursday
Which day comes before Sunday?|Saturday|Monday|Friday|Tuesday
Which month comes after January?|February|March|December|June
Which month comes after November?|December|October|January|April
Which season is the coldest?|winter|summer|spring|autumn
Which season is the hottest?|summer|winter|autumn|spring
What is the first letter of the English alphabet?|A|Z|M|B
What is the last letter of the English alphabet?|Z|A|Y|X
Which planet do we live on?|Earth|Mars|Venus|Jupiter
What gives us light during the day?|the Sun|the Moon|the stars|a lamp
What do we see in the sky at night?|the Moon|the Sun|a rainbow|a cloud
What falls from clouds when it rains?|water|sand|stones|leaves
What is frozen water called?|ice|steam|sand|glass
What do plants need from the sky to grow?|sunlight|darkness|snow|smoke
Which is the largest ocean on Earth?|the Pacific Ocean|the Indian Ocean|the Arctic Ocean|a small lake
What do we breathe in to stay alive?|air|water|sand|oil
In which direction does the sun rise?|east|west|north|south
What do bees make?|honey|milk|bread|silk
What do cows give us to drink?|milk|juice|tea|coffee
What do you use to cut paper?|scissors|a spoon|a pillow|a cup
What do you use to write on paper?|a pen|a fork|a shoe|a plate
What do you wear on your feet?|shoes|hats|gloves|scarves
What do you wear on your head?|a hat|a sock|a shoe|a belt
Where do fish live?|in water|in trees|in the desert|in the sky
Where do birds build nests?|in trees|in the ocean|under water|in a fridge
What do you use to see?|eyes|ears|hands|feet
What do you use to hear?|ears|eyes|nose|knees
What do you use to smell?|nose|ears|elbows|hair
What do people sleep on?|a bed|a table|a door|a window
What do you use to eat soup?|a spoon|a knife|a pencil|a comb
Where do you keep food cold?|in a refrigerator|in an oven|in a closet|in a drawer
What do you cook food in?|an oven|a bathtub|a shoe|a book
What do cars need to run?|fuel|milk|paper|sand
Which fruit is red and grows on trees?|apple|banana|lemon|grape
Which vegetable is orange and long?|carrot|potato|onion|pea
What is bread made from?|flour|stone|plastic|glass
Where do people go to borrow books?|a library|a bakery|a garage|a beach
Who teaches students at school?|a teacher|a pilot|a farmer|a baker
Who flies an airplane?|a pilot|a chef|a doctor|a farmer
Who helps sick people in a hospital?|a doctor|a pilot|a painter|a singer
Who puts out fires?|a firefighter|a teacher|a baker|a writer
What do you call a person who grows food on a farm?|a farmer|a sailor|a dentist|a judge
What do you use to call a friend far away?|a phone|a spoon|a chair|a shoe
What do you open to walk into a house?|the door|the roof|the floor|the wall
What do you use to tell the time?|a clock|a cup|a brush|a ball
What do you use an umbrella for?|rain|cooking|reading|sleeping
What melts when it gets warm?|ice|stone|wood|glass
What do trees grow from?|seeds|rocks|clouds|bones
What is the main language spoken in England?|English|French|Chinese|Arabic
What is the main language spoken in France?|French|German|Japanese|Russian
What is the main language spoken in Spain?|Spanish|Italian|Dutch|Greek
Which is the biggest?|an elephant|a mouse|an ant|a cat
Which is the smallest?|an ant|a horse|a whale|a bear
Which is the hottest?|fire|ice|snow|rain
Which is the heaviest?|a car|a feather|a leaf|a pencil
Which one is a fruit?|an apple|a chair|a rock|a car
Which one is a vegetable?|a carrot|a shoe|a book|a spoon
Which one is a tool?|a hammer|an apple|a cloud|a song
Which one is a musical instrument?|a piano|a carrot|a pillow|a sock
Which one is a body of water?|a lake|a mountain|a desert|a forest
Which one is a vehicle?|a bus|a tree|a flower|a pillow
""".strip()


def items(table: str, seed: int) -> list[dict]:
    rng = random.Random(seed)
    out = []
    for line in table.splitlines():
        question, answer, *wrong = [part.strip() for part in line.split("|")]
        if len(wrong) != 3 or answer in wrong:
            raise ValueError(f"bad item: {line!r}")
        choices = wrong[:]
        pos = rng.randrange(4)
        choices.insert(pos, answer)
        out.append({"id": len(out), "question": question, "choices": choices, "answer": pos})
    return out


def main() -> None:
    OUT.mkdir(parents=True, exist_ok=True)
    rows = items(FACTS, seed=23)
    (OUT / "pipeline_facts.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    print(f"{len(rows)} items -> {OUT / 'pipeline_facts.jsonl'}")


if __name__ == "__main__":
    main()
