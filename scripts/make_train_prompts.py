#!/usr/bin/env python3
"""Build the bundled prompt set for draft-head self-distillation training.

The target model (SmolLM2-135M-Instruct) answers these prompts and a draft head is trained on
its answers, so the prompts only need to be varied, natural single-turn chat requests that
draw answers of roughly 50-300 tokens. Everything here is hand-written for this project:
topic lists and task templates are combined with a fixed seed, and a set of free-form prompts
is added as is. Standard library only, no network; the same code writes the same bytes.

Each prompt gets a stable split: "heldout" for about 10% of them, chosen by a SHA-256 hash of
the prompt text (never Python's salted hash()), else "train". Prompts equal (after case and
whitespace folding) to one in specsplit/data/prompts.jsonl are left out.

    python scripts/make_train_prompts.py [--out specsplit/data/train_prompts.jsonl]
"""

from __future__ import annotations

import argparse
import hashlib
import json
import random
import sys
from collections.abc import Callable, Iterable
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_OUT = ROOT / "specsplit" / "data" / "train_prompts.jsonl"
DEFAULT_EXCLUDE = ROOT / "specsplit" / "data" / "prompts.jsonl"

SEED = 20240611
HELDOUT_PERCENT = 10
MIN_WORDS, MAX_WORDS = 5, 80

# ---------------------------------------------------------------------------------------------
# Slot fillers shared by several templates.
# ---------------------------------------------------------------------------------------------

AUDIENCES = [
    "a ten-year-old",
    "a curious teenager",
    "a high school student",
    "an adult who left school long ago",
    "someone with no background in the subject",
    "a busy office worker",
]
COUNTS = ["three", "four", "five", "six", "seven"]
SMALL_COUNTS = ["three", "four", "five"]

# ---------------------------------------------------------------------------------------------
# Topics, grouped by kind; each kind has its own task templates so that every combination
# reads naturally. Slots: {x} the topic, {n} a count, {audience}, {lang} (tech only).
# ---------------------------------------------------------------------------------------------

CONCEPTS = [
    "plate tectonics",
    "the water cycle",
    "black holes",
    "vaccination",
    "DNA and genes",
    "natural selection",
    "the greenhouse effect",
    "inflation",
    "compound interest",
    "supply and demand",
    "the Pythagorean theorem",
    "probability",
    "prime numbers",
    "gravity",
    "electric circuits",
    "Earth's seasons",
    "the circulatory system",
    "the stages of sleep",
    "ocean tides",
    "volcanoes",
    "the phases of the Moon",
    "antibiotic resistance",
    "credit scores",
    "the scientific method",
    "solar power",
    "fractions",
    "the metric system",
    "radiocarbon dating",
    "confirmation bias",
    "index funds",
]
CONCEPT_TEMPLATES = [
    "Explain {x} in simple terms for {audience}.",
    "Can you explain {x} in {k} sentences?",
    "What is a good everyday analogy for {x}? Explain how the analogy works.",
    "What are some common misconceptions about {x}?",
    "Why {does} {x} matter in everyday life? Give a couple of concrete examples.",
    "Write {m} multiple-choice quiz questions about {x}, with the correct answers marked.",
    "Summarize the key ideas of {x} as a short bulleted list.",
    "I'm studying {x} for an exam tomorrow. What are the most important points to remember?",
    "Write a short poem that explains {x}.",
    "How could a teacher introduce {x} to a class of twelve-year-olds? "
    "Describe one simple activity.",
    "Give me {n} surprising facts related to {x}.",
    "Explain {x} in the style of an enthusiastic teacher talking to complete beginners.",
    "Write a short dialogue in which a student asks a teacher about {x} "
    "and the teacher explains {obj} clearly.",
    "Give a clear, short definition of {x} and one real-world example.",
]

SKILLS = [
    "baking sourdough bread",
    "learning to play the guitar",
    "training for a first 5K race",
    "starting a vegetable garden",
    "learning a new language as an adult",
    "writing a cover letter",
    "preparing for a job interview",
    "starting a daily meditation practice",
    "creating a monthly budget",
    "saving for retirement",
    "paying off credit card debt",
    "giving a presentation at work",
    "taking better photos with a smartphone",
    "learning to touch type",
    "caring for houseplants",
    "studying effectively for exams",
    "decluttering a small apartment",
    "cooking healthy meals on a budget",
    "learning to swim as an adult",
    "building a daily exercise habit",
    "reducing screen time",
    "learning to draw portraits",
    "making friends in a new city",
    "managing stress at work",
    "packing for a long trip with only a carry-on bag",
    "learning Python as a complete beginner",
    "maintaining a bicycle",
    "starting a personal blog",
    "training a puppy to sit and stay",
    "negotiating a salary offer",
    "going camping for the first time",
    "reading more books",
]
SKILL_TEMPLATES = [
    "Give me {n} practical tips for {x}.",
    "What are the most common mistakes people make when {x}?",
    "Write a short step-by-step guide to {x}.",
    "I want to get started with {x}. Where should I begin?",
    "Break {x} down into small, manageable steps.",
    "What tools or resources are helpful for {x}?",
    "Write a short motivational message for someone who is struggling with {x}.",
    "My friend thinks {x} is too hard for them. What encouraging advice could I give?",
    "How long does it usually take to get good at {x}, and how can I track my progress?",
    "What are the benefits of {x}? List a few and explain each briefly.",
    "Explain the single most important principle behind {x} in one short paragraph.",
    "What is one small thing I could do today to make progress on {x}?",
]

COUNTRIES_AND_CITIES = [
    "Japan",
    "Iceland",
    "Peru",
    "Morocco",
    "New Zealand",
    "Canada",
    "Egypt",
    "Italy",
    "Kenya",
    "Norway",
    "Vietnam",
    "Mexico City",
    "Barcelona",
    "Istanbul",
    "Scotland",
    "Australia",
    "Portugal",
    "India",
]
COUNTRY_TEMPLATES = [
    "What is {x} best known for?",
    "Give me {n} interesting facts about {x}.",
    "Describe the geography and climate of {x} in a short paragraph.",
    "What is the best time of year to visit {x}, and why?",
    "Suggest a relaxed three-day plan for a first-time visitor to {x}.",
    "What traditional foods should I try when visiting {x}?",
    "Write a short travel blog paragraph describing a first morning in {x}.",
    "Give a brief overview of the history of {x}.",
    "What local customs or etiquette should a visitor to {x} know about?",
    "I'm on a small budget. How can I travel around {x} cheaply?",
    "Write a short poem inspired by {x}.",
]

NATURAL_PLACES = [
    "the Amazon rainforest",
    "the Sahara Desert",
    "the Great Barrier Reef",
    "the Alps",
    "the Grand Canyon",
    "Antarctica",
    "the Himalayas",
    "Yellowstone National Park",
    "the Dead Sea",
]
NATURE_TEMPLATES = [
    "What {be} {x} best known for?",
    "Give me {n} interesting facts about {x}.",
    "How did {x} form? Explain it simply.",
    "What plants and animals live in {x}?",
    "What threats {does} {x} face today, and what is being done to protect {obj}?",
    "Describe {x} to someone who has never seen {obj}.",
    "Write a short poem inspired by {x}.",
    "What should a visitor know to stay safe when exploring {x}?",
    "Explain the climate of {x} in a short paragraph.",
]

EVENTS = [
    "the French Revolution",
    "the fall of the Western Roman Empire",
    "the Industrial Revolution",
    "the Apollo 11 Moon landing",
    "the invention of the printing press",
    "the building of the Egyptian pyramids",
    "the Renaissance",
    "the Black Death",
    "the fall of the Berlin Wall",
    "the American Civil War",
    "trade along the Silk Road",
    "the ancient Olympic Games",
    "the outbreak of World War I",
    "the Age of Exploration",
]
EVENT_TEMPLATES = [
    "Summarize {x} in a short paragraph for a high school student.",
    "What led to {x}, and what were {its} main consequences?",
    "Create a short timeline of the key moments of {x}.",
    "Write a diary entry from the point of view of an ordinary person living during {x}.",
    "What are {n} things most people don't know about {x}?",
    "Explain how {x} changed everyday life for ordinary people.",
    "Write {m} quiz questions about {x}, each with a short answer.",
    "What lessons can we learn today from {x}?",
    "Which important people were involved in {x}, and what roles did they play?",
    "Describe {x} in five bullet points.",
]

SHE = ("Marie Curie", "Ada Lovelace", "Frida Kahlo", "Cleopatra")
PEOPLE = [
    "Marie Curie",
    "Leonardo da Vinci",
    "Ada Lovelace",
    "Nelson Mandela",
    "Isaac Newton",
    "Frida Kahlo",
    "Albert Einstein",
    "Cleopatra",
    "Charles Darwin",
    "Wolfgang Amadeus Mozart",
    "Mahatma Gandhi",
    "Galileo Galilei",
]
# Object and possessive pronouns for the people above.
PEOPLE_PRONOUNS = {name: ("her", "her") if name in SHE else ("him", "his") for name in PEOPLE}

PEOPLE_TEMPLATES = [
    "Write a short biography of {x}.",
    "What is {x} best remembered for?",
    "Write {n} questions you would like to ask {x} if you could interview {obj}.",
    "Explain the most important achievements of {x} to a ten-year-old.",
    "What challenges did {x} face during {its} life?",
    "Give me {n} interesting facts about {x}.",
    "Why is {x} still relevant today?",
    "Write a short speech introducing {x} at a school history event.",
]

ANIMALS = [
    "octopuses",
    "honeybees",
    "elephants",
    "penguins",
    "wolves",
    "dolphins",
    "owls",
    "sea turtles",
    "ants",
    "bats",
    "cheetahs",
    "koalas",
    "crows",
    "salmon",
    "hummingbirds",
    "frogs",
]
ANIMAL_TEMPLATES = [
    "Give me {n} fascinating facts about {x}.",
    "How do {x} find food and protect themselves from predators?",
    "Where do {x} live, and how are they adapted to their habitat?",
    "Why are {x} important to their ecosystem?",
    "Write a short children's story about a family of {x}.",
    "Write a short poem about {x}.",
    "How do {x} communicate with each other?",
    "Are {x} endangered? Explain the main threats they face.",
    "Explain the life cycle of {x} in simple terms.",
    "What are some common myths about {x}, and what is the truth?",
]

DISHES = [
    "banana bread",
    "vegetable stir-fry",
    "pizza dough",
    "French onion soup",
    "guacamole",
    "tomato pasta sauce",
    "pancakes",
    "chicken curry",
    "lentil soup",
    "chocolate chip cookies",
    "Greek salad",
    "scrambled eggs",
    "fried rice",
    "hummus",
]
DISH_TEMPLATES = [
    "Give me a simple recipe for {x}.",
    "What are the most common mistakes people make when making {x}?",
    "How can I make {x} healthier without losing flavor?",
    "Suggest {n} creative variations on classic {x}.",
    "What ingredient substitutions work well in {x}?",
    "Write a short, appetizing description of {x} for a restaurant menu.",
    "What drinks or dishes pair well with {x}?",
    "Explain step by step how to make {x} for someone who rarely cooks.",
    "How should I store leftover {x}, and how long {does} {it} keep?",
]

ISSUES = [
    "working from home",
    "electric cars",
    "nuclear power",
    "social media use by teenagers",
    "homeschooling",
    "a four-day work week",
    "school uniforms",
    "self-driving cars",
    "banning single-use plastics",
    "universal basic income",
    "letting children play video games",
    "government spending on space exploration",
]
ISSUE_TEMPLATES = [
    "What are the pros and cons of {x}?",
    "Give a balanced overview of the arguments for and against {x}.",
    "Write a short persuasive paragraph in favor of {x}.",
    "Write a short persuasive paragraph arguing against {x}.",
    "How might {x} affect ordinary families over the next ten years?",
    "What questions should someone ask before forming an opinion on {x}?",
    "Summarize the main points of the debate about {x} in {n} bullet points.",
    "Write an opening statement for a school debate on {x}.",
]

CULTURE = [
    "jazz",
    "the blues",
    "hip hop",
    "classical music",
    "impressionist painting",
    "haiku poetry",
    "soccer",
    "basketball",
    "tennis",
    "chess",
    "marathon running",
    "rock and roll",
    "ballet",
    "origami",
    "cricket",
]
CULTURE_TEMPLATES = [
    "Where did {x} come from, and how did it develop?",
    "What are the key features that make {x} distinctive?",
    "How can a complete beginner start to enjoy {x}?",
    "Explain the basic rules or conventions of {x} in simple terms.",
    "Give me {n} interesting facts about {x}.",
    "Why do so many people love {x}? Answer in a short paragraph.",
    "Write a short poem about {x}.",
    "Who are some of the most influential figures in {x}, and why?",
]

TECH = [
    ("list comprehensions", "Python"),
    ("decorators", "Python"),
    ("generators", "Python"),
    ("exceptions and try/except blocks", "Python"),
    ("dictionaries", "Python"),
    ("virtual environments", "Python"),
    ("recursion", "Python"),
    ("regular expressions", "Python"),
    ("unit testing", "Python"),
    ("classes and objects", "Python"),
    ("promises and async/await", "JavaScript"),
    ("closures", "JavaScript"),
    ("array methods like map and filter", "JavaScript"),
    ("event listeners", "JavaScript"),
    ("SQL joins", "SQL"),
    ("database indexes", "SQL"),
    ("GROUP BY and aggregate functions", "SQL"),
    ("pipes and redirection", "shell"),
    ("file permissions and chmod", "shell"),
    ("environment variables", "shell"),
    ("git branches", "git"),
    ("Big O notation", ""),
    ("HTTP status codes", ""),
    ("JSON", ""),
]
TECH_TEMPLATES = [
    "Explain {x} with a short {lang} example.",
    "What are common mistakes beginners make with {x}?",
    "Write {m} interview questions about {x}, each with a short answer.",
    "Explain {x} to someone who is just starting to learn programming.",
    "Write a short cheat sheet for {x}.",
    "Give me a small practice exercise about {x}, followed by its solution.",
    "Why {be} {x} useful? Explain with one practical example.",
]
TECH_TEMPLATES_NO_LANG = [
    "Explain {x} with a simple example.",
    "What are common mistakes beginners make with {x}?",
    "Write {m} interview questions about {x}, each with a short answer.",
    "Explain {x} to someone who is just starting to learn programming.",
    "Write a short cheat sheet for {x}.",
    "Why {be} {x} important for programmers? Explain with one practical example.",
]

SINGULAR_TECH = ("recursion", "unit testing", "Big O notation", "JSON")
# Topics above that take a plural verb ("black holes are", "the Alps are").
PLURAL_TOPICS = frozenset(
    [
        "black holes",
        "DNA and genes",
        "prime numbers",
        "electric circuits",
        "Earth's seasons",
        "the stages of sleep",
        "ocean tides",
        "volcanoes",
        "the phases of the Moon",
        "credit scores",
        "fractions",
        "index funds",
        "the Alps",
        "the Himalayas",
        "the ancient Olympic Games",
        "pancakes",
        "chocolate chip cookies",
        "scrambled eggs",
        "electric cars",
        "school uniforms",
        "self-driving cars",
        *ANIMALS,
        *(topic for topic, _ in TECH if topic not in SINGULAR_TECH),
    ]
)

# ---------------------------------------------------------------------------------------------
# Comparisons: (a, b, optional situation phrase that follows "between a and b").
# ---------------------------------------------------------------------------------------------

PAIRS: list[tuple[str, str, str]] = [
    ("a laptop", "a desktop computer", "for university studies"),
    ("Python", "JavaScript", "as a first programming language"),
    ("renting an apartment", "buying a home", "if I might move cities in a few years"),
    ("a virus", "a bacterium", ""),
    ("weather", "climate", ""),
    ("tea", "coffee", "if I want to cut down on caffeine"),
    ("running", "swimming", "to improve my overall fitness"),
    ("an e-book reader", "printed books", "since I travel a lot"),
    ("stocks", "bonds", ""),
    ("a debit card", "a credit card", "as a college student"),
    ("SQL databases", "NoSQL databases", "for a small web application"),
    ("git merge", "git rebase", ""),
    ("TCP", "UDP", ""),
    ("HTTP", "HTTPS", ""),
    ("RAM", "disk storage", ""),
    ("mitosis", "meiosis", ""),
    ("a crocodile", "an alligator", ""),
    ("a frog", "a toad", ""),
    ("baking soda", "baking powder", "for baking a cake"),
    ("olive oil", "butter", "for everyday cooking"),
    ("white rice", "brown rice", "for a healthy diet"),
    ("yoga", "pilates", "because I have a stiff back"),
    ("a gym membership", "working out at home", "as a busy parent"),
    ("traveling by train", "flying", "for a 600-kilometer trip"),
    ("a hostel", "a hotel", "as a solo backpacker"),
    ("the Roman Republic", "the Roman Empire", ""),
    ("the Renaissance", "the Enlightenment", ""),
    ("capitalism", "socialism", ""),
    ("a simile", "a metaphor", ""),
    ("affect", "effect", ""),
    ("British English", "American English", ""),
    ("Spanish", "Portuguese", "as an English speaker learning a second language"),
    ("classical music", "jazz", ""),
    ("an acoustic guitar", "an electric guitar", "as a complete beginner"),
    ("soccer", "American football", ""),
    ("tennis", "badminton", ""),
    ("a cat", "a dog", "for a family in a small apartment"),
    ("a savings account", "index funds", "if I am saving for twenty years"),
    ("a fixed-rate mortgage", "a variable-rate mortgage", "as a first-time home buyer"),
    ("cardio", "strength training", "if I want to lose weight"),
    ("a mechanical keyboard", "a membrane keyboard", "since I type all day"),
    ("Linux", "Windows", "as a software developer"),
    ("spreadsheets", "databases", "to track inventory for a small shop"),
    ("online courses", "in-person classes", "to learn a new language"),
    ("hurricanes", "tornadoes", ""),
    ("asteroids", "comets", ""),
    ("the Arctic", "Antarctica", ""),
    ("Mars", "Venus", ""),
    ("nuclear fission", "nuclear fusion", ""),
    ("frozen vegetables", "fresh vegetables", "on a tight student budget"),
    ("a gas stove", "an induction cooktop", "for a new kitchen"),
    ("electric cars", "hybrid cars", "since my family drives a lot"),
    ("paper notebooks", "note-taking apps", "at university"),
    ("Bash", "Python", "to automate simple file tasks"),
    ("React", "plain JavaScript", "for a small personal website"),
    ("unit tests", "integration tests", ""),
    ("a compiler", "an interpreter", ""),
    ("the mean", "the median", ""),
    ("speed", "velocity", ""),
    ("empathy", "sympathy", ""),
    ("a republic", "a constitutional monarchy", ""),
]
PAIR_TEMPLATES = [
    "What are the main differences between {a} and {b}?",
    "Compare {a} and {b} in a few short bullet points.",
    "How are {a} and {b} similar, and how are they different?",
    "Explain the difference between {a} and {b} with a simple example.",
]
PAIR_SITUATION_TEMPLATES = [
    "I'm deciding between {a} and {b} {c}. Which would you recommend, and why?",
    "What are the pros and cons of {a} versus {b} {c}?",
]

# ---------------------------------------------------------------------------------------------
# Programming tasks.
# ---------------------------------------------------------------------------------------------

PYTHON_TASKS = [
    "checks whether a string is a palindrome, ignoring case and spaces",
    "counts how many times each word appears in a sentence",
    "returns the second largest number in a list",
    "removes duplicates from a list while keeping the original order",
    "converts a temperature from Celsius to Fahrenheit",
    "checks whether a number is prime",
    "flattens a list of lists into a single list",
    "returns the factorial of a number using recursion",
    "merges two sorted lists into one sorted list",
    "finds the most common character in a string",
    "checks whether two words are anagrams of each other",
    "reverses the order of the words in a sentence",
    "returns all the even numbers from a list",
    "calculates the average of a list of numbers and returns None for an empty list",
    "capitalizes the first letter of every word in a string",
    "counts the vowels in a string",
    "reads a text file and returns the number of lines in it",
    "checks that a password has at least eight characters, one digit, and one uppercase letter",
    "finds the greatest common divisor of two integers",
    "splits a list into chunks of a given size",
    "rotates a list to the right by k positions",
    "checks whether a year is a leap year",
    "converts a Roman numeral to an integer",
    "converts an integer to a binary string without using bin()",
    "computes the sum of the digits of an integer",
    "returns the common elements of two lists without duplicates",
    "finds the longest word in a sentence",
    "removes all punctuation from a string",
    "groups a list of words by their first letter",
    "checks whether a list is sorted in ascending order",
    "computes simple interest from a principal, a yearly rate, and a number of years",
    "generates a random password of a given length",
    "counts the days between two dates given as strings in YYYY-MM-DD format",
    "finds the missing number in a list that contains 1 to n with one number missing",
    "returns the transpose of a matrix stored as a list of lists",
    "compresses a string like 'aaabbc' into 'a3b2c1'",
    "checks whether the parentheses in a string are balanced",
    "returns a dictionary that maps each number in a list to its square",
    "finds all pairs of numbers in a list that add up to a target sum",
    "converts a snake_case string to camelCase",
    "performs binary search on a sorted list and returns the index or -1",
    "calculates body mass index from weight in kilograms and height in meters",
    "returns the first non-repeating character in a string",
    "sorts a list of dictionaries by a given key",
    "counts the words in a text file",
    "prints a multiplication table for a given number",
    "checks whether a number is a perfect square without using math.sqrt",
    "shortens a string to a maximum length and adds '...' if it was cut",
    "computes the running total of a list of numbers",
    "removes all keys whose value is None from a dictionary",
    "converts a number of minutes into a string like '2 hours 15 minutes'",
    "returns the median of a list of numbers",
    "checks whether a string looks like a valid email address using a regular expression",
    "counts the uppercase and lowercase letters in a string",
    "sorts a list of numbers using bubble sort",
    "generates the first n rows of Pascal's triangle",
    "formats a dictionary as a string with one 'key: value' pair per line",
    "returns the largest sum of two adjacent numbers in a list",
]
PYTHON_TASK_TEMPLATES = [
    "Write a Python function that {t}.",
    "Write a Python function that {t}. Include a short docstring.",
    "Write a Python function that {t}, and show one example of calling it.",
    "How can I write a Python function that {t}? Please explain the code briefly.",
    "Write a short Python function that {t}, then explain how it works in two or three sentences.",
]

JS_TASKS = [
    "debounces another function by a given number of milliseconds",
    "capitalizes the first letter of a string",
    "returns the largest number in an array",
    "removes duplicate values from an array",
    "checks whether an object has no properties",
    "counts how often each item appears in an array",
    "formats a number as a price with two decimal places",
    "shuffles an array randomly",
    "fetches JSON from a URL with async/await and handles errors",
    "converts a string to kebab-case",
    "returns the number of days until a given date",
    "makes a deep copy of a simple object",
    "groups an array of objects by a property name",
    "checks whether a string is a valid hexadecimal color code",
    "sums all the numbers in a nested array",
    "returns an array of the integers from start to end",
    "shortens a string to a given number of words",
    "toggles a CSS class on an element when a button is clicked",
    "sorts an array of objects by a date property",
    "turns an object into a URL query string",
    "returns the values that two arrays have in common",
    "counts the words in a string",
    "waits a given number of milliseconds using a Promise",
    "finds the longest string in an array",
]
JS_TASK_TEMPLATES = [
    "Write a JavaScript function that {t}.",
    "Show me how to write a JavaScript function that {t}.",
    "Write a short JavaScript function that {t}, with a usage example.",
]

SQL_TABLES = {
    "employees": "a table employees(id, name, department, salary, hire_date)",
    "orders": "a table orders(id, customer_id, order_date, total)",
    "customers_orders": "tables customers(id, name, city) and orders(id, customer_id, total)",
    "products": "a table products(id, name, category, price, stock)",
    "students": "a table students(id, name, grade, score)",
    "books": "a table books(id, title, author, year, pages)",
}
SQL_TASKS = [
    ("employees", "returns the three highest-paid employees"),
    ("employees", "finds the average salary in each department"),
    ("employees", "lists the employees hired in 2023, newest first"),
    ("employees", "counts the employees in each department that has more than five people"),
    ("orders", "calculates the total revenue for each month"),
    ("orders", "finds the customers who placed more than ten orders"),
    ("orders", "returns the five most recent orders"),
    ("customers_orders", "lists each customer's name with their total spending"),
    ("customers_orders", "finds the customers who have never placed an order"),
    ("customers_orders", "shows the number of orders per city"),
    ("products", "lists the products that are out of stock"),
    ("products", "finds the most expensive product in each category"),
    ("products", "raises the price of every product in the 'books' category by 10 percent"),
    ("students", "returns the students whose score is above the class average"),
    ("students", "ranks the students by score within each grade"),
    ("students", "counts how many students passed, if the passing score is 60"),
    ("books", "finds the authors who have written more than three books"),
    ("books", "lists the books published before 1950, sorted by year"),
    ("books", "finds the average number of pages per author"),
    ("books", "deletes every book that has no author"),
]
SQL_TASK_TEMPLATES = [
    "Given {table}, write a SQL query that {t}.",
    "I have {table}. How do I write a SQL query that {t}?",
    "Write a SQL query that {t}, using {table}. Explain the query briefly.",
]

SHELL_TASKS = [
    "find all files larger than 100 MB in my home directory",
    "count the lines in every .py file in a folder",
    "rename all .jpeg files in a directory to .jpg",
    "show the ten largest directories under the current folder",
    "search every text file in a folder tree for the word TODO",
    "delete log files that are older than 30 days",
    "see which process is using port 8080",
    "compress a folder into a tar.gz archive",
    "extract a tar.gz archive into a specific directory",
    "download a file from a URL on the command line",
    "print the last 50 lines of a log file and keep following new lines",
    "replace every occurrence of 'foo' with 'bar' in a file",
    "count the unique IP addresses in a web server access log",
    "make a shell script executable and run it",
    "check how much free disk space is left",
    "run a command every five minutes with cron",
    "loop over all .txt files in a directory and print their names",
    "sort a CSV file by its second column",
    "back up a directory into a copy with today's date in its name",
    "list all files modified in the last 24 hours",
    "set an environment variable permanently for my user",
    "compare two text files and see the differences",
    "stop a process that is not responding",
    "copy a folder to a remote server over SSH",
]
SHELL_TASK_TEMPLATES = [
    "How do I {t} in a Linux terminal?",
    "What shell command would I use to {t}? Explain each part of the command.",
    "Write a bash command or a short script to {t}.",
]

# (language, snippet) pairs. BUGGY ones have a mistake; CORRECT ones are to be explained.
BUGGY_SNIPPETS = [
    ("Python", "def add_item(item, items=[]):\n    items.append(item)\n    return items"),
    ("Python", "names = ['Ann', 'Bob', 'Cy']\nfor i in range(1, len(names)):\n    print(names[i])"),
    ("Python", 'age = input("Age: ")\nprint("Next year you will be " + age + 1)'),
    ("Python", "for n in numbers:\n    if n % 2 == 0:\n        numbers.remove(n)"),
    ("Python", 'if name is "admin":\n    grant_access()'),
    ("Python", "def square(x):\n    result = x * x\n\nprint(square(4))"),
    ("Python", "count = 0\n\ndef increment():\n    count += 1\n\nincrement()"),
    ("Python", "counts = {}\nfor word in words:\n    counts[word] += 1"),
    ("Python", "i = 0\nwhile i < 10:\n    print(i)"),
    ("Python", "def countdown(n):\n    print(n)\n    countdown(n - 1)"),
    ("Python", 'total = 0\nfor price in ["3.50", "2.25"]:\n    total += price\nprint(total)'),
    (
        "Python",
        "def is_even(n):\n    if n % 2 == 0:\n        return True\n    else:\n        False",
    ),
    ("JavaScript", "for (var i = 0; i < 3; i++) {\n  setTimeout(() => console.log(i), 100);\n}"),
    ("JavaScript", 'const total = "5" + 3;\nconsole.log(total); // I expected 8'),
    ("JavaScript", 'if (items.length = 0) {\n  console.log("empty");\n}'),
    (
        "JavaScript",
        'async function load() {\n  const res = fetch("/api/data");\n  return res.json();\n}',
    ),
    ("JavaScript", "const scores = [10, 9, 100];\nscores.sort();\nconsole.log(scores);"),
    ("SQL", "SELECT department, AVG(salary)\nFROM employees;"),
    ("SQL", "SELECT name FROM users WHERE email = NULL;"),
    ("SQL", "SELECT customer_id, COUNT(*)\nFROM orders\nWHERE COUNT(*) > 5\nGROUP BY customer_id;"),
    ("Bash", "for f in $(ls *.txt); do\n  cp $f backup/\ndone"),
    ("Bash", 'if [ $name == "" ]; then\n  echo "empty"\nfi'),
]
BUGGY_TEMPLATES = [
    "This {lang} code has a bug. Can you find and fix it?\n\n{code}",
    "Why doesn't this {lang} code work as expected, and how should I fix it?\n\n{code}",
    "What is wrong with this {lang} code? Explain the problem and show a corrected version."
    "\n\n{code}",
]

CORRECT_SNIPPETS = [
    ("Python", "squares = [x * x for x in range(10) if x % 2 == 0]"),
    ("Python", 'with open("notes.txt") as f:\n    for line in f:\n        print(line.strip())'),
    ("Python", 'from collections import Counter\n\nprint(Counter("mississippi").most_common(2))'),
    ("Python", 'def greet(name="world"):\n    return f"Hello, {name}!"'),
    ("Python", 'data = {"a": 1, "b": 2}\nfor key, value in data.items():\n    print(key, value)'),
    ("Python", "words.sort(key=len, reverse=True)\nprint(words[:3])"),
    ("Python", "try:\n    value = int(text)\nexcept ValueError:\n    value = 0"),
    ("Python", 'numbers = list(map(int, "4 8 15 16".split()))'),
    ("Python", "a, b = b, a"),
    (
        "Python",
        "def memo(f):\n    cache = {}\n    def wrapper(n):\n        if n not in cache:\n"
        "            cache[n] = f(n)\n        return cache[n]\n    return wrapper",
    ),
    ("Python", "evens = list(filter(lambda n: n % 2 == 0, range(20)))"),
    ("JavaScript", "const doubled = [1, 2, 3].map(n => n * 2);"),
    ("JavaScript", "const { name, age } = person;\nconsole.log(`${name} is ${age}`);"),
    (
        "JavaScript",
        'document.querySelector("#btn").addEventListener("click", () => {\n  alert("Hello!");\n});',
    ),
    ("JavaScript", "const total = cart.reduce((sum, item) => sum + item.price, 0);"),
    (
        "SQL",
        "SELECT c.name, COUNT(o.id)\nFROM customers c\n"
        "LEFT JOIN orders o ON o.customer_id = c.id\nGROUP BY c.name;",
    ),
    ("SQL", "SELECT title FROM books\nORDER BY year DESC\nLIMIT 5;"),
    ("Bash", 'grep -rn "error" logs/ | wc -l'),
    ("Bash", 'find . -name "*.log" -mtime +7 -delete'),
    ("Bash", "ps aux | sort -k 3 -nr | head -5"),
]
CORRECT_TEMPLATES = [
    "Explain what this {lang} code does, line by line:\n\n{code}",
    "What does this {lang} code do? Keep the explanation short.\n\n{code}",
    "Can you explain this {lang} snippet to a beginner?\n\n{code}",
]

# ---------------------------------------------------------------------------------------------
# Language tasks: translation, formal rewrites, grammar fixes, definitions.
# ---------------------------------------------------------------------------------------------

SENTENCES_TO_TRANSLATE = [
    "Where is the nearest train station?",
    "I would like a cup of coffee, please.",
    "My brother works at a hospital.",
    "We are going to the beach tomorrow.",
    "Can you help me find my keys?",
    "The museum opens at nine in the morning.",
    "I have been learning to cook for two years.",
    "How much does this shirt cost?",
    "It is raining, so take an umbrella.",
    "My favorite season is autumn.",
    "The children are playing in the park.",
    "I forgot my phone at home.",
    "Could you speak more slowly, please?",
    "The library is closed on Sundays.",
    "She reads a book every week.",
    "We need to buy bread and milk.",
    "What time does the last bus leave?",
    "I am allergic to peanuts.",
    "Thank you for your help yesterday.",
    "The weather is beautiful today.",
    "My grandmother lives in a small village.",
    "I would like to book a table for four people.",
    "Do you know a good restaurant nearby?",
    "He plays the piano very well.",
    "The train was late this morning.",
    "Let's meet in front of the cinema at seven.",
    "I don't understand this question.",
    "Our house has a red door and a small garden.",
    "Please turn off the lights when you leave.",
    "I am looking for a pharmacy.",
    "The cat is sleeping on the sofa.",
    "We visited three cities during our vacation.",
    "Is breakfast included in the price?",
    "My sister is studying medicine.",
    "I usually go to work by bike.",
    "Can I pay by credit card?",
    "This soup is too salty.",
    "The meeting has been moved to Thursday.",
    "I lost my passport and need help.",
    "Happy birthday! I hope you have a wonderful day.",
    "The store is on the left, next to the bank.",
    "We are tired because we walked all day.",
    "What do you like to do on weekends?",
    "I need a room with two beds.",
    "The movie was better than the book.",
    "Please call me when you arrive.",
    "My computer is not working.",
    "Where can I buy a ticket?",
    "It takes twenty minutes to walk to school.",
    "I have two cats and a dog.",
]
TRANSLATE_LANGUAGES = ["French", "Spanish"]
TRANSLATE_TEMPLATES = [
    'Translate this sentence into {lang} and explain any words a learner might find tricky: "{s}"',
    'How do you say "{s}" in {lang}? Please break the translation down word by word.',
    'Translate "{s}" into {lang} and briefly explain the grammar.',
    'What is the {lang} translation of "{s}"? Give a formal and an informal version.',
    'Translate into {lang}, then give one similar example sentence with its translation: "{s}"',
]

INFORMAL_MESSAGES = [
    "hey, can't make it to the meeting tmrw, something came up",
    "gonna be late, traffic is nuts",
    "thx for the stuff you sent, it was super helpful",
    "the printer's broken again, somebody fix it pls",
    "we need that report asap or we're in trouble",
    "sorry i messed up the numbers in the spreadsheet",
    "can u send me the files from last week?",
    "the new guy is pretty good, we should keep him",
    "not feeling great so i'm staying home today",
    "your package got lost, we'll send another one",
    "that idea is kind of bad, let's try something else",
    "just checking if you saw my last email",
    "can we push the deadline a bit? we're swamped",
    "awesome job on the presentation yesterday!",
    "i want my money back, the blender broke after two days",
    "the wifi in the office is super slow again",
    "i think there's a mistake on my bill",
    "can't find the key to the storage room, anyone seen it?",
    "let me know if the new schedule works for you",
    "we're out of coffee, someone grab some",
    "the client loved it, we got the contract!",
    "don't forget your timesheets by friday",
    "need a couple days off next week for family stuff",
    "who took my lunch from the fridge??",
    "the site's down, we're looking into it",
    "yeah sure, tuesday works",
    "nope, that's not gonna work for us",
    "can you cover my shift on sunday? i'll owe you one",
    "the numbers look weird, did someone change the formula?",
    "just a heads up, the boss is in a bad mood today",
    "ur invoice is late again, pay up pls",
    "meeting's moved to 3, same room",
]
FORMAL_TEMPLATES = [
    'Rewrite this message in a formal, professional tone: "{s}"',
    "Make this sound more polite and professional: {s}",
    'How could I say this more formally in a work email? "{s}"',
]

GRAMMAR_SENTENCES = [
    "Me and him goes to the store every Saturday.",
    "Their going to arrive at there house late.",
    "The team have finished it's project.",
    "If I would have known, I would of came earlier.",
    "She don't know nothing about it.",
    "I seen that movie three times already.",
    "The informations you gave me was very useful.",
    "Between you and I, the plan is not working.",
    "He runned to the store and buyed some milk.",
    "There is many reasons to learn a second language.",
    "Less people came to the meeting than we expected.",
    "I am agree with your opinion.",
    "She has went to the doctor yesterday.",
    "The book what I read was interesting.",
    "We was planning to go but it rained.",
    "Your the best friend I ever had.",
    "Each of the students have a laptop.",
    "I didn't went to school because I was sick.",
    "The dog wagged it's tail when it seen me.",
    "Who's car is parked outside?",
    "They was happy with there results.",
    "The childrens played in the garden all afternoon.",
    "Neither the teacher nor the students was ready.",
    "She is more taller than her brother.",
    "Me and my friends goes hiking on weekends.",
    "He don't have no time for breakfast.",
    "It's raining, so bring you're umbrella.",
    "The list of items are on the table.",
    "I am working here since three years.",
    "She sings very good.",
    "We discussed about the problem for an hour.",
    "Everyone have their own opinion about it.",
]
GRAMMAR_TEMPLATES = [
    'Correct the grammar in this sentence and explain each change: "{s}"',
    "Fix the grammatical mistakes in this sentence: {s}",
    'What is grammatically wrong with this sentence, and how should it read? "{s}"',
]

TERMS = [
    "opportunity cost",
    "metaphor",
    "irony",
    "algorithm",
    "biodiversity",
    "democracy",
    "mortgage",
    "placebo effect",
    "entropy",
    "latitude",
    "API",
    "bandwidth",
    "cloud computing",
    "diversification",
    "empathy",
    "procrastination",
    "sustainability",
    "gross domestic product",
    "alliteration",
    "onomatopoeia",
    "hypothesis",
    "catalyst",
    "recession",
    "dividend",
    "net worth",
    "gig economy",
    "carbon footprint",
    "mindfulness",
    "cholesterol",
    "metabolism",
    "calorie",
    "passive voice",
    "impostor syndrome",
    "burnout",
    "simile",
    "adverb",
    "conjunction",
    "thesis statement",
    "paradox",
    "subjunctive mood",
    "compiler",
    "open-source software",
    "encryption",
    "firewall",
    "machine learning",
    "phishing",
    "two-factor authentication",
    "feudalism",
    "colonialism",
    "peninsula",
    "river delta",
    "monsoon",
    "erosion",
    "equinox",
    "light-year",
    "standard deviation",
    "percentage point",
    "budget deficit",
    "tariff",
    "interest rate",
    "sonnet",
    "tempo",
    "chord",
    "umami",
    "fermentation",
    "sous vide",
    "al dente",
    "jet lag",
    "layover",
    "hibernation",
    "camouflage",
    "migration",
    "carnivore",
    "offside",
    "hat-trick",
    "stalemate",
    "ecosystem",
    "osmosis",
]
TERM_TEMPLATES = [
    'Define the term "{t}" and give an example.',
    'What does "{t}" mean? Explain it in plain English.',
    'What is the meaning of "{t}"? Use it in an example sentence.',
    'Give a short dictionary-style definition of "{t}", followed by an everyday example.',
]

# ---------------------------------------------------------------------------------------------
# Short passages to summarize or rework (each under about 65 words).
# ---------------------------------------------------------------------------------------------

PASSAGES = [
    "Honeybees share the location of flowers through a movement called the waggle dance. A "
    "forager returning to the hive moves in a figure-eight pattern, and the angle of the "
    "straight part shows the direction of the food relative to the sun. The length of the "
    "waggle tells the other bees how far away the flowers are.",
    "The city council voted on Tuesday to turn the old railway line into a walking and "
    "cycling path. Supporters say the project will reduce traffic and give residents a safe "
    "place to exercise. Some business owners worry about the cost, which is expected to reach "
    "four million dollars over three years.",
    "Sleep plays an essential role in memory. During deep sleep, the brain replays the "
    "experiences of the day and strengthens the connections that store them. Studies show "
    "that students who sleep well after studying remember more than those who stay up late "
    "reviewing the same material.",
    "The printing press, developed by Johannes Gutenberg around 1440, made it possible to "
    "produce books quickly and cheaply. Before its invention, books were copied by hand and "
    "were very expensive. Within decades, printed books spread across Europe, helping ideas "
    "travel faster and increasing literacy.",
    "Our company will move to a hybrid schedule starting next month. Employees will work from "
    "the office on Tuesdays, Wednesdays, and Thursdays, and may work from home on Mondays and "
    "Fridays. Team leaders can approve exceptions for people with long commutes or caring "
    "responsibilities.",
    "Composting turns kitchen scraps and garden waste into rich soil. Microorganisms break "
    "down vegetable peels, coffee grounds, and dry leaves. A good compost pile needs a "
    "balance of green and brown materials, enough moisture, and regular turning to let air "
    "in. After a few months, the result can be used to feed plants.",
    "Maya had trained for the marathon for six months, but on race day it poured with rain. "
    "At mile twenty her legs felt like stone, and she thought about stopping. Then she saw "
    "her younger brother holding a soggy handmade sign with her name on it. She smiled, kept "
    "running, and crossed the finish line in tears.",
    "Coral reefs cover less than one percent of the ocean floor, yet they support about a "
    "quarter of all marine species. Rising ocean temperatures cause corals to expel the algae "
    "living inside them, a process known as bleaching. If the water stays warm for too long, "
    "the corals can die.",
    "The new smartphone has a larger battery, a brighter screen, and a camera that performs "
    "well in low light. However, reviewers noted that it is heavier than the previous model "
    "and that the price has gone up by one hundred dollars. The phone goes on sale in early "
    "October.",
    "Regular physical activity offers benefits far beyond weight control. Exercise improves "
    "mood, lowers the risk of heart disease, and helps people sleep better. Experts recommend "
    "that adults get at least 150 minutes of moderate activity each week, such as brisk "
    "walking, cycling, or swimming.",
    "The library will be closed from June 3 to June 10 while new shelves and computers are "
    "installed. During this time, books can be returned to the drop box by the main "
    "entrance. Online services, including e-book loans, will remain available. The library "
    "will reopen with longer evening hours.",
    "Volcanoes form where molten rock, called magma, rises to the surface of the Earth. Many "
    "lie along the edges of tectonic plates, especially around the Pacific Ocean in an area "
    "known as the Ring of Fire. Eruptions can be dangerous, but volcanic soil is very fertile, "
    "which is why many farms grow nearby.",
    "When Leo opened the old wooden box in his grandfather's attic, he found a bundle of "
    "letters tied with a faded blue ribbon. They were written in French and dated 1944. Leo "
    "didn't speak French, but one name appeared again and again: Camille. He decided to find "
    "out who she was.",
    "Many people believe that multitasking makes them more productive, but research suggests "
    "the opposite. When we switch between tasks, the brain needs time to refocus, and small "
    "mistakes become more likely. Working on one task at a time, with short breaks, often "
    "leads to better results in less time.",
    "The Great Wall of China is not a single wall but a series of walls built over many "
    "centuries. Different dynasties added sections to protect against invasions from the "
    "north. The most famous parts, near Beijing, were built during the Ming dynasty and are "
    "made of brick and stone.",
    'To reset your password, click "Forgot password" on the login page and enter the email '
    "address linked to your account. You will receive a link that is valid for thirty "
    "minutes. Choose a new password with at least twelve characters. If the email does not "
    "arrive, check your spam folder.",
    "Octopuses are remarkably intelligent animals. They can solve puzzles, open jars, and "
    "escape from tanks. Each of their eight arms contains many neurons, so the arms can react "
    "to touch and taste somewhat independently. Octopuses can also change the color and "
    "texture of their skin in a fraction of a second.",
    "The town's annual food festival attracted more than twenty thousand visitors this "
    "weekend. Local restaurants offered small dishes at low prices, and a cooking contest for "
    "young chefs drew large crowds. Organizers said the event raised money for the community "
    "garden and plan to make it bigger next year.",
    "Inflation happens when the general level of prices rises over time, which means each "
    "unit of money buys less. Moderate inflation is normal in a growing economy, but very "
    "high inflation hurts savers and makes planning difficult. Central banks often raise "
    "interest rates to slow it down.",
    "Version 2.0 of the app introduces a dark mode, faster search, and the ability to share "
    "lists with friends. Several bugs have been fixed, including a crash when uploading large "
    "photos. Users on older phones may notice that some animations were removed to improve "
    "performance.",
    "Learning a musical instrument as an adult can be hard, but it has real advantages. "
    "Adults tend to practice with more focus and understand music theory more easily than "
    "children. The key is to set realistic goals, practice a little every day, and enjoy "
    "small improvements along the way.",
    "The Amazon rainforest stores enormous amounts of carbon and is home to millions of "
    "species, many of which have not yet been studied. Clearing land for farming and logging "
    "threatens this ecosystem, and scientists warn that large areas could turn into dry "
    "grassland if deforestation continues.",
    "Our hiking club meets every Saturday at 8 a.m. in the parking lot of Pine Hill Park. "
    "Walks last three to four hours and are suitable for beginners. Please bring water, "
    "snacks, and sturdy shoes. In case of heavy rain, the walk is canceled and members are "
    "told by text message.",
    "Ada Lovelace worked with Charles Babbage on his design for a mechanical computer called "
    "the Analytical Engine. In her notes, she described how the machine could follow a "
    "sequence of instructions, and she imagined it might one day compose music. Many people "
    "consider her the first computer programmer.",
]
PASSAGE_TEMPLATES = [
    "Summarize the following passage in one sentence:\n\n{p}",
    "Give me a two-sentence summary of this text:\n\n{p}",
    "What is the main idea of this passage?\n\n{p}",
    "List the three most important points from this text:\n\n{p}",
    "Summarize this for a busy reader in under 30 words:\n\n{p}",
    "Rewrite this passage in simpler language for a young reader:\n\n{p}",
    "Suggest a good title for this passage and explain your choice:\n\n{p}",
    "Write two questions a teacher could ask to check understanding of this text:\n\n{p}",
]

# ---------------------------------------------------------------------------------------------
# Creative writing: emails, stories, poems.
# ---------------------------------------------------------------------------------------------

EMAIL_SITUATIONS = [
    "my landlord asking when the broken heater will be repaired",
    "a professor asking for a one-week extension on an essay",
    "a hiring manager thanking them for yesterday's interview",
    "my team announcing that Friday's meeting is canceled",
    "a neighbor apologizing for the noise from my party last night",
    "a customer explaining that their order will arrive three days late",
    "a colleague asking them to review my presentation slides",
    "my manager requesting a day off next Friday",
    "a hotel asking whether early check-in is possible",
    "a client following up on an unpaid invoice",
    "a friend declining their wedding invitation because I will be abroad",
    "a support team reporting that my new headphones stopped working",
    "my child's teacher asking how my son is doing in math",
    "a new coworker welcoming her to the team",
    "a local bakery asking whether they can make a gluten-free birthday cake",
    "a former manager asking if she would write me a recommendation letter",
    "my gym asking to cancel my membership",
    "a conference organizer asking whether there is still space to register",
    "my team thanking everyone for finishing a difficult project",
    "a supplier asking for a price quote for 200 office chairs",
    "my doctor's office asking to reschedule an appointment",
    "a food bank offering to volunteer at their next event",
    "an unhappy customer, apologizing for poor service and offering a discount",
    "my coworkers inviting them to a farewell lunch for a retiring colleague",
    "a recruiter saying I am no longer interested in the position",
    "an author telling her how much I enjoyed her latest book",
    "my bank asking about an unexpected fee on my account",
    "a moving company asking for a quote to move a two-bedroom apartment",
    "the organizer of a weekend chess club asking how to join",
    "a colleague reminding him that our report is due tomorrow",
    "my building manager reporting a water leak in the hallway",
    "a restaurant asking to book a private room for a birthday dinner",
    "a teammate sharing notes from a meeting she missed",
    "a school asking about enrollment for next year",
    "a freelance designer asking if she is available for a logo project",
    "an old friend congratulating him on his new job",
    "an airline requesting a refund for a canceled flight",
    "my landlord giving one month's notice that I am moving out",
]
EMAIL_TEMPLATES = [
    "Write a short, polite email to {s}.",
    "Draft a brief email to {s}. Keep it under 120 words.",
    "Help me write a friendly but professional email to {s}.",
]

STORY_PREMISES = [
    "a lighthouse keeper who finds a message in a bottle",
    "a robot who wants to learn how to paint",
    "a girl who discovers that her grandmother's garden is magic",
    "two strangers stuck in an elevator during a power outage",
    "a cat who becomes the mayor of a small town",
    "a chef who loses his sense of taste the day before a big competition",
    "a time traveler who accidentally arrives at her own tenth birthday",
    "a dragon who is afraid of fire",
    "an astronaut who hears music on the far side of the Moon",
    "a boy who trades his shadow for a bag of coins",
    "a village where it has not rained for ten years",
    "an old man who feeds the pigeons in the park every day",
    "a detective who solves crimes using only her sense of smell",
    "a tree that remembers everyone who has sat beneath it",
    "a shy librarian who finds a book that writes itself",
    "a fox and a crow who become unlikely friends",
    "the last bookstore in a city full of screens",
    "a student who wakes up able to understand animals",
    "a ghost who is afraid of people",
    "a family road trip where everything goes wrong",
    "a small fishing boat caught in a storm",
    "a musician who plays one final concert in an empty hall",
    "a kid who builds a rocket out of cardboard boxes",
    "a town where everyone must tell the truth for one day",
    "a baker whose bread makes people remember their childhood",
    "a penguin who wants to see the desert",
    "a mail carrier delivering a letter that is fifty years late",
    "a snowman who wishes he could see summer",
    "an inventor whose machine can stop time for one minute",
    "a girl who finds a door at the back of her closet",
]
STORY_TEMPLATES = [
    "Write a short story (under 200 words) about {p}.",
    "Write a bedtime story for young children about {p}.",
    "Write the opening paragraph of a story about {p}.",
    "Tell a very short story about {p}, with a surprising ending.",
    "Write a 100-word story about {p}.",
]

POEM_SUBJECTS = [
    "a rainy Monday morning",
    "the first snowfall of winter",
    "a cup of hot coffee",
    "an old pair of running shoes",
    "the ocean at night",
    "a city waking up",
    "friendship",
    "missing home",
    "a cat sleeping in the sun",
    "the last day of summer vacation",
    "a lighthouse in a storm",
    "learning to ride a bike",
    "a busy train station",
    "the smell of fresh bread",
    "stars over the desert",
    "a grandmother's kitchen",
    "a quiet library",
    "spring flowers after a long winter",
    "a summer thunderstorm",
    "the full moon",
    "a mountain sunrise",
    "time passing",
    "a forgotten umbrella",
    "the sound of rain on a roof",
    "fireworks on New Year's Eve",
    "a garden in autumn",
    "starting a new job",
    "a walk in the forest",
    "a river flowing to the sea",
    "an empty playground at dusk",
]
POEM_TEMPLATES = [
    "Write a haiku about {s}, then briefly explain its imagery.",
    "Write a limerick about {s}.",
    "Write a four-line rhyming poem about {s}.",
    "Write a free-verse poem of about eight lines about {s}.",
    "Write a cheerful poem for children about {s}.",
]

# ---------------------------------------------------------------------------------------------
# Free-form prompts that fit no template, used as written.
# ---------------------------------------------------------------------------------------------

FREE_FORM = [
    # Factual questions.
    "Why do cats purr, and what does it mean?",
    "How many bones are in the adult human body, and which one is the largest?",
    "Who wrote 'Pride and Prejudice', and what is the novel about?",
    "What causes thunder during a storm?",
    "Why is the ocean salty but most rivers are not?",
    "How does a refrigerator keep food cold?",
    "What is the tallest mountain in Africa, and how high is it?",
    "Why do we have leap years?",
    "About how far away is the Moon from the Earth?",
    "Why is Portuguese the main language spoken in Brazil?",
    "How do airplanes stay in the air? Explain lift simply.",
    "Why do leaves change color in the fall?",
    "How does a microwave oven heat food?",
    "What is the largest desert in the world? Is it hot or cold?",
    "Why do onions make people cry when they cut them?",
    "How long does it take light from the Sun to reach Earth?",
    "Why does water boil at a lower temperature on top of a high mountain?",
    "Who is credited with inventing the telephone, and when?",
    "What is the longest river in South America?",
    "Why do humans get goosebumps?",
    "How do bees turn nectar into honey?",
    "What was the Rosetta Stone, and why was it important?",
    "How does the GPS in my phone know where I am?",
    "Why does bread go stale, and can stale bread be saved?",
    "What are the three common states of matter? Give an example of each.",
    "Why do some people need glasses to see clearly?",
    "How fast does sound travel through air?",
    "Why is Pluto no longer considered a planet?",
    "What causes the northern lights?",
    "How do noise-canceling headphones work?",
    "Why do people yawn, and is it really contagious?",
    "What is the smallest country in the world by area?",
    "How is a rainbow formed?",
    "What does the CPU actually do inside a computer?",
    "Why do ice cubes float in a glass of water?",
    "Who painted the Mona Lisa, and why is it so famous?",
    "What is the difference between a meteor and a meteorite?",
    "How does a credit card company make money?",
    "Why do people have different blood types?",
    "Where does the word 'salary' come from?",
    "How did the Vikings navigate across the open ocean?",
    "Why does the Moon look bigger when it is near the horizon?",
    "How does washing with soap remove germs from our hands?",
    "What are the main ingredients of traditional miso soup?",
    "How do chameleons change color?",
    "What is a solar eclipse, and how often does one happen?",
    "Why does the Sun look red and orange at sunset?",
    "How do fish breathe underwater?",
    "What is the International Space Station used for?",
    "Why do we see lightning before we hear thunder?",
    # Arithmetic and small math.
    "What is 17 multiplied by 24? Show how you calculated it.",
    "What is 15% of 240? Explain the steps.",
    "Calculate 3/4 + 2/3 and simplify the result.",
    "What is the square root of 196, and how can I check it?",
    "Convert 0.375 into a fraction in lowest terms.",
    "What is 1,000 divided by 8? Show the long division.",
    "If x + 7 = 19, what is x? Explain how you solved it.",
    "Solve for x: 3x - 5 = 16.",
    "What is 2 to the power of 10, and why do programmers care about it?",
    "Round 3.14159 to two decimal places and explain the rounding rule.",
    "What is 25% of 80 plus 10% of 50?",
    "Convert 72 degrees Fahrenheit to Celsius and show the formula.",
    "How many minutes are there in one week?",
    "What is the least common multiple of 12 and 18?",
    "Is 91 a prime number? Explain your reasoning.",
    "What is 7/8 written as a percentage?",
    "Simplify the expression 2(x + 3) - 4x.",
    "What is the average of 12, 15, 20, and 33?",
    "Solve this system of equations: x + y = 10 and x - y = 4.",
    "What is 12.5 times 8? Is there a quick mental trick for it?",
    "How many seconds are there in three hours?",
    "What is the perimeter of a square whose area is 49 square meters?",
    "Expand and simplify (x + 2)(x - 5).",
    "What is the next number in the sequence 2, 6, 12, 20, 30? Explain the pattern.",
    "A pizza is cut into 8 slices and I eat 3. What fraction of the pizza is left?",
    "What is 0.2 multiplied by 0.3, and why is the answer smaller than both numbers?",
    # Code questions.
    "What does the `yield` keyword do in Python? Show a tiny example.",
    "Why does `print(0.1 + 0.2)` in Python show 0.30000000000000004?",
    "In Python, what is the difference between `append` and `extend` on a list?",
    "What is the output of this Python code, and why?\n\n"
    "x = [1, 2, 3]\ny = x\ny.append(4)\nprint(x)",
    'What does `if __name__ == "__main__":` mean at the bottom of a Python file?',
    "How do I read a CSV file in Python with the csv module? Show a short example.",
    "What is the difference between `git pull` and `git fetch`?",
    "How do I undo my last git commit but keep the changes in my files?",
    "What does `SELECT DISTINCT` do in SQL? Give an example.",
    'In JavaScript, why does `typeof null` return "object"?',
    "What does this JavaScript print, and why?\n\n"
    "console.log([1, 2, 3].map(x => x * 2).filter(x => x > 2));",
    "How can I make this Python code faster or shorter?\n\n"
    "result = []\nfor i in range(1000000):\n    result.append(i * 2)",
    "What does `chmod 755 script.sh` do?",
    "What is the difference between `*args` and `**kwargs` in Python?",
    "How do I sort a Python dictionary by its values?",
    "What does this regular expression match? `^\\d{3}-\\d{4}$`",
    "Why do I get 'IndentationError: expected an indented block' in Python?",
    "What does `2>&1` mean at the end of a shell command?",
    "How do I center a div horizontally and vertically with CSS?",
    "What is the difference between `null` and `undefined` in JavaScript?",
    "What will this Python code print?\n\n"
    "for i in range(3):\n    for j in range(i):\n        print(i, j)",
    "How do I check whether a key exists in a Python dictionary?",
    "What is SQL injection, and how do parameterized queries prevent it?",
    "What is the difference between a process and a thread?",
    "Rewrite this Python code as a list comprehension:\n\n"
    "names = []\nfor user in users:\n    if user.active:\n        names.append(user.name)",
    "Convert this JavaScript function to an arrow function:\n\n"
    "function add(a, b) {\n  return a + b;\n}",
    "Which HTTP status code should an API return when a requested resource does not exist?",
    "How do I get today's date in Python and format it as YYYY-MM-DD?",
    "Why is it a bad idea to store passwords in plain text, and what should I do instead?",
    "What is the time complexity of looking up a key in a Python dictionary?",
    "What does the `-r` flag do in `rm -r folder`, and why should I be careful with it?",
    "Explain the difference between `==` and `is` in Python with an example.",
    "What is a Python virtual environment, and how do I create one with venv?",
    "How do I write a docstring for a Python function? Show a good example.",
    # Everyday advice and conversation.
    "I just moved to a new city and don't know anyone. How can I meet people?",
    "My roommate keeps leaving dirty dishes in the sink. "
    "How can I bring it up without starting a fight?",
    "I have a job interview tomorrow and I'm really nervous. Any advice?",
    "Can you recommend a few habits for staying focused while working from home?",
    "I keep forgetting to drink water during the day. What can I do?",
    "What's a good way to say no to extra work without upsetting my boss?",
    "My friend is going through a breakup. What can I say to support her?",
    "What should I pack for a weekend hiking trip in the mountains?",
    "I'm hosting dinner for six people on Saturday. Can you suggest a simple menu?",
    "What are some fun things to do indoors on a rainy day with kids?",
    "How do I politely remind a friend that they still owe me money?",
    "I have 20 minutes for lunch every day. What quick, healthy meals could I make?",
    "What's a good gift for a coworker who is retiring?",
    "I feel overwhelmed by my to-do list. How should I decide what to do first?",
    "How can I make my small balcony feel cozier?",
    "What questions should I ask when viewing an apartment to rent?",
    "My dog barks every time someone walks past the window. How can I help him stop?",
    "I'd like to start running but I get bored quickly. How can I keep it interesting?",
    "How do I write a thank-you note to my child's teacher at the end of the year?",
    "What should I do if I lock myself out of my house?",
    "What's the best way to remember new vocabulary in a foreign language?",
    "I'm planning a surprise birthday party for my partner. What should I keep in mind?",
    "How can I keep my phone battery healthy for longer?",
    "My houseplants keep dying even though I water them. What could be going wrong?",
    "How do I start a conversation with a stranger at a networking event?",
    "I have a ten-hour flight coming up. How can I stay comfortable on the plane?",
    "What are some good icebreaker questions for a team meeting?",
    "How can I save money on groceries without eating badly?",
    "I want to give constructive feedback to a colleague. How should I phrase it?",
    "What should I do in my first week at a new job to make a good impression?",
    "How do I clean a cast iron pan properly?",
    "I'm bored of my usual breakfast. Can you suggest some new ideas?",
    "What is a polite way to leave a party early?",
    "How can I stop checking my phone first thing in the morning?",
    "My neighbor plays loud music late at night. How should I handle it?",
    "How do I choose a ripe watermelon at the store?",
    "What's a simple way to start keeping a journal?",
    "I want to learn to cook. Which five basic dishes should I master first?",
    "How can I help my teenager cope with exam stress?",
    "Hi! Can you tell me a fun fact to brighten my day?",
    "I'm feeling unmotivated today. Can you give me a short pep talk?",
    "Can you tell me a clean joke about computers?",
    "Suggest three names for a small coffee shop near a university.",
    "What would be a good name for a golden retriever puppy? Give me a few options.",
    "I have eggs, spinach, cheese, and bread. What can I make for dinner?",
    "Can you suggest a 15-minute stretching routine for after work?",
    "What are some good questions to ask my grandparents about their lives?",
    "I have a free Sunday with no plans. Plan a relaxing day for me.",
    "How do I explain to my kids why we recycle?",
    "Please write a short toast for my best friend's wedding.",
    "Write a two-sentence product description for a reusable water bottle.",
    "Give me a short riddle and its answer.",
    "Write a friendly reminder for our book club meeting on Thursday at 7 p.m.",
    "Suggest five weekend project ideas for someone learning Python.",
    "Write a tweet-length announcement for a neighborhood cleanup event on Saturday.",
    "Summarize the basic rules of chess in a few sentences.",
    "Describe the taste of a lemon to someone who has never tried one.",
    "Write a short LinkedIn headline for a junior data analyst.",
    "Create a simple weekly chore chart for a family of four.",
    "Good morning! What's a nice way to start the day with a bit of energy?",
    "Thanks for the help earlier. Can you now give me three tips for writing clear emails?",
    "My sister's birthday is next week and she loves hiking. What should I get her?",
    # Longer requests with some context.
    "I'm a nurse who works night shifts three times a week, and on my days off I struggle to "
    "fall asleep at a normal time. Melatonin makes me groggy. What are some practical "
    "strategies for switching between a night schedule and a day schedule?",
    "My team of five developers keeps missing sprint deadlines. Most tasks turn out bigger "
    "than we estimated, and people get pulled into support requests in the middle of the "
    "week. As the team lead, what changes could I try over the next month to make our "
    "planning more reliable?",
    "I'm writing a short speech for my grandfather's 80th birthday. He was a carpenter, loves "
    "fishing, and taught all of us grandchildren how to play cards. Can you write a warm, "
    "slightly funny speech of about 150 words that I could read at the dinner?",
    "I run a small bakery and want to post on social media three times a week, but I never "
    "know what to write. Give me ten post ideas that would show off our bread and pastries "
    "and help people get to know the staff.",
    "I'm learning Python and wrote a script that reads a 2 GB log file with f.readlines() "
    "and then loops over the lines to count errors. It uses a lot of memory and is slow. How "
    "should I change the approach, and why is it better?",
    "My parents are visiting me in Chicago for four days in October. They are in their "
    "seventies and enjoy museums and good food, but they can't walk long distances. Can you "
    "suggest a relaxed plan with one or two main activities per day?",
    "I have $2,000 in savings, a credit card balance of $1,500 at 24% interest, and a stable "
    "job. Should I use my savings to pay off the card, or keep the money as an emergency "
    "fund? Explain the trade-offs.",
    "Our neighborhood wants to start a community garden on an empty lot owned by the city. "
    "About fifteen families are interested. What steps should we take to get permission, "
    "organize the work, and make sure the garden is shared fairly?",
    "I teach English to a group of adult beginners who are shy about speaking. Most of them "
    "understand written English better than spoken English. Suggest five classroom "
    "activities that would encourage them to talk without feeling embarrassed.",
    "Here is my function:\n\ndef get_user(users, name):\n    for u in users:\n"
    "        if u['name'] == name:\n            return u\n\nIt returns None when the user "
    "is missing, and my code later crashes with a TypeError. What are better ways to handle "
    "a missing user?",
    "I'm 35, have never exercised regularly, and want to run 5 kilometers without stopping "
    "by the end of the summer. I can train three times a week for about 30 minutes. What "
    "would a sensible plan look like?",
    "I want to write a mystery story for a creative writing class. It must be under 1,500 "
    "words and set in a single location. Suggest three possible settings and plot ideas, "
    "each with a twist that would work in a short piece.",
    "My eight-year-old daughter asked me why the sky is dark at night if there are so many "
    "stars. I didn't know how to answer. How could I explain it in a way a child would "
    "understand?",
    "We are a family of four moving from a house into a two-bedroom apartment next month, "
    "and we own far too much: clothes, toys, books, and kitchen gadgets. How should we decide "
    "what to keep, sell, donate, or throw away?",
    "I manage a small online shop, and customers often email to ask where their order is. "
    "Write a friendly template reply that explains typical delivery times, how to use the "
    "tracking link, and what to do if the package is more than a week late.",
    "I'm preparing a ten-minute presentation about renewable energy for my high school "
    "class. The audience knows the basics but gets bored easily. What structure would you "
    "suggest, and what facts or visuals could keep them engaged?",
    "I have a SQL table called sales with the columns region, product, sale_date, and "
    "amount. My manager wants a report of total sales per region for each month of last "
    "year. How would I write that query, and how can I make the output easy to read?",
    "A close friend asked to borrow a large amount of money to start a business. I want to "
    "help, but I'm worried it could hurt our friendship if things go badly. How can I think "
    "this through, and what could I say to her?",
    "I'm trying to eat less meat for health and environmental reasons, but my family loves "
    "hearty dinners. Suggest five filling vegetarian dinners that even meat lovers might "
    "enjoy, with a one-line description of each.",
    "My JavaScript code fetches data from an API when the page loads, but sometimes the page "
    "shows 'undefined' because the data hasn't arrived yet. What is happening, and what is "
    "the usual way to wait for the data before rendering?",
    "I just adopted a three-year-old rescue cat who hides under the bed most of the day and "
    "only comes out at night to eat. It has been a week. How can I help her feel safe and "
    "settle into her new home?",
    "I'm a university student with a part-time job, and I keep leaving assignments until the "
    "night before they are due. I know it's a problem but can't seem to change. What "
    "realistic techniques could help me start earlier?",
]

# ---------------------------------------------------------------------------------------------
# Math word problems, built from random numbers: each generator returns one problem.
# ---------------------------------------------------------------------------------------------

NAMES = [
    ("Maria", "she"),
    ("James", "he"),
    ("Aisha", "she"),
    ("Tom", "he"),
    ("Priya", "she"),
    ("Lucas", "he"),
    ("Mei", "she"),
    ("Omar", "he"),
    ("Sofia", "she"),
    ("Daniel", "he"),
    ("Hana", "she"),
    ("Carlos", "he"),
]
MATH_SUFFIXES = ["", " Show your work.", " Explain each step.", " Solve it step by step."]
ITEMS = ["notebooks", "apples", "movie tickets", "bus passes", "paintbrushes", "coffee mugs"]


def _money(cents: int) -> str:
    return f"${cents // 100}.{cents % 100:02d}" if cents % 100 else f"${cents // 100}"


def _m_shopping(r: random.Random) -> str:
    name, pron = r.choice(NAMES)
    n, item = r.randint(3, 9), r.choice(ITEMS)
    return (
        f"{name} buys {n} {item} at {_money(r.randrange(150, 1200, 25))} each and pays with a "
        f"{r.choice(['$50', '$100'])} bill. How much change does {pron} get?"
    )


def _m_speed(r: random.Random) -> str:
    hours, speed = r.randint(2, 6), r.randrange(40, 130, 5)
    return (
        f"A train travels {hours * speed} kilometers in {hours} hours. "
        "What is its average speed in kilometers per hour?"
    )


def _m_discount(r: random.Random) -> str:
    item = r.choice(["jacket", "pair of shoes", "backpack", "lamp", "bicycle"])
    return (
        f"A {item} costs ${r.randrange(20, 300, 5)} and is on sale for "
        f"{r.choice([10, 15, 20, 25, 30, 40])}% off. What is the sale price?"
    )


def _m_recipe(r: random.Random) -> str:
    base, grams = r.choice([2, 4, 6]), r.randrange(150, 600, 50)
    target = r.choice([x for x in (3, 5, 8, 9, 10, 12) if x != base])
    return (
        f"A recipe for {base} people uses {grams} grams of flour. "
        f"How much flour is needed for {target} people?"
    )


def _m_work_rate(r: random.Random) -> str:
    a, b = r.sample([2, 3, 4, 5, 6, 8, 10, 12], 2)
    return (
        f"One painter can paint a room in {a} hours and another can paint it in {b} hours. "
        "How long will it take them working together?"
    )


def _m_ages(r: random.Random) -> str:
    younger, diff = r.randint(5, 30), r.randint(2, 9)
    return (
        f"The sum of the ages of two sisters is {2 * younger + diff}, and the older sister is "
        f"{diff} years older than the younger one. How old is each sister?"
    )


def _m_area(r: random.Random) -> str:
    width = r.randint(3, 20)
    length = width + r.randint(2, 15)
    return (
        f"A rectangular garden is {length} meters long and {width} meters wide. What is its "
        "area, and how much fencing is needed to go all the way around it?"
    )


def _m_savings(r: random.Random) -> str:
    name, pron = r.choice(NAMES)
    weekly = r.randrange(10, 60, 5)
    goal = r.choice(["a new bike", "a concert ticket", "a tablet", "a weekend trip"])
    return (
        f"{name} saves ${weekly} every week and already has ${r.randrange(10, 100, 10)}. "
        f"How many weeks will it take {name} to have ${r.randrange(200, 800, 25)} "
        f"for {goal}, assuming {pron} spends none of it?"
    )


def _m_interest(r: random.Random) -> str:
    return (
        f"If you deposit ${r.randrange(500, 10000, 250)} in an account that pays "
        f"{r.choice([2, 3, 4, 5, 6])}% simple interest per year, how much interest will you "
        f"earn after {r.randint(2, 8)} years?"
    )


def _m_unit_price(r: random.Random) -> str:
    a, b = r.choice([(300, 500), (400, 750), (250, 600), (500, 1000)])
    pa = r.randrange(199, 450, 10)
    pb = pa * b // a + r.randrange(-60, 60, 10)
    return (
        f"A {a}-gram box of cereal costs {_money(pa)} and a {b}-gram box costs {_money(pb)}. "
        "Which box is the better deal?"
    )


def _m_clock(r: random.Random) -> str:
    hour, minute = r.randint(1, 9), r.choice([0, 10, 15, 20, 30, 45, 50])
    return (
        f"A movie starts at {hour}:{minute:02d} p.m. and lasts {r.randint(85, 175)} minutes. "
        "What time does it end?"
    )


def _m_test_average(r: random.Random) -> str:
    scores = [r.randint(60, 95) for _ in range(4)]
    targets = [t for t in range(60, 100, 5) if 50 <= 5 * t - sum(scores) <= 100]
    return (
        f"A student scored {scores[0]}, {scores[1]}, {scores[2]}, and {scores[3]} on four "
        f"tests. What score is needed on the fifth test for an average of "
        f"{r.choice(targets)}?"
    )


def _m_ratio(r: random.Random) -> str:
    a, b = r.choice([(2, 3), (3, 4), (3, 5), (4, 5), (5, 7), (1, 2)])
    total = (a + b) * r.randint(3, 6)
    return (
        f"In a class of {total} students, the ratio of boys to girls is {a}:{b}. "
        "How many girls are in the class?"
    )


def _m_fuel(r: random.Random) -> str:
    return (
        f"A car uses {r.choice([5, 6, 7, 8, 9])} liters of fuel per 100 kilometers. How much "
        f"fuel does it need for a trip of {r.randrange(150, 900, 50)} kilometers, and what will "
        f"it cost at {_money(r.randrange(140, 210, 5))} per liter?"
    )


def _m_percent_change(r: random.Random) -> str:
    start = r.randrange(2000, 20000, 500)
    end = start + start * r.choice([5, 8, 10, 12, 15, 20, 25]) // 100
    return (
        f"A town's population grew from {start:,} to {end:,} in ten years. "
        "By what percentage did it increase?"
    )


def _m_bill(r: random.Random) -> str:
    return (
        f"A dinner bill comes to {_money(r.randrange(4000, 24000, 50))}. If {r.randint(3, 8)} "
        f"friends add a {r.choice([10, 15, 18, 20])}% tip and split the total evenly, how much "
        "does each person pay?"
    )


def _m_marbles(r: random.Random) -> str:
    red, green, blue = r.randint(2, 12), r.randint(2, 12), r.randint(2, 12)
    color = r.choice(["red", "green", "blue"])
    return (
        f"A bag contains {red} red, {green} green, and {blue} blue marbles. If you pick one "
        f"marble at random, what is the probability that it is {color}?"
    )


def _m_laps(r: random.Random) -> str:
    name, pron = r.choice(NAMES)
    return (
        f"{name} runs {r.randint(5, 30)} laps of a {r.choice([200, 250, 400])}-meter track. "
        f"How many kilometers has {pron} run?"
    )


def _m_consecutive(r: random.Random) -> str:
    k = r.randint(5, 120)
    return f"The sum of three consecutive integers is {3 * k + 3}. What are the integers?"


def _m_tank(r: random.Random) -> str:
    fill = r.randint(8, 25)
    leak = r.randint(2, fill - 3)
    volume = (fill - leak) * r.randint(10, 40)
    return (
        f"A water tank holds {volume} liters. A pipe fills it at {fill} liters per minute, "
        f"but a leak drains {leak} liters per minute. How long does it take to fill the "
        "empty tank?"
    )


def _m_tiles(r: random.Random) -> str:
    return (
        f"How many square tiles measuring {r.choice([20, 25, 50])} centimeters on each side "
        f"are needed to cover a floor that is {r.randint(2, 8)} meters by "
        f"{r.randint(2, 6)} meters?"
    )


def _m_overtime(r: random.Random) -> str:
    name, pron = r.choice(NAMES)
    return (
        f"{name} earns ${r.randint(14, 35)} per hour and worked {r.randint(42, 52)} hours "
        "this week. Hours beyond 40 are paid at 1.5 times the normal rate. "
        f"How much did {pron} earn this week?"
    )


def _m_split_cost(r: random.Random) -> str:
    n = r.randint(3, 7)
    return (
        f"{n} friends rent a vacation house for {_money(r.randrange(30000, 150000, 500))} for "
        f"{r.randint(2, 7)} nights. How much does each friend pay per night?"
    )


MATH_GENERATORS: list[Callable[[random.Random], str]] = [
    _m_shopping,
    _m_speed,
    _m_discount,
    _m_recipe,
    _m_work_rate,
    _m_ages,
    _m_area,
    _m_savings,
    _m_interest,
    _m_unit_price,
    _m_clock,
    _m_test_average,
    _m_ratio,
    _m_fuel,
    _m_percent_change,
    _m_bill,
    _m_marbles,
    _m_laps,
    _m_consecutive,
    _m_tank,
    _m_tiles,
    _m_overtime,
    _m_split_cost,
]
MATH_PER_GENERATOR = 13

# ---------------------------------------------------------------------------------------------
# Assembly.
# ---------------------------------------------------------------------------------------------


def _fill(template: str, r: random.Random, x: str, **slots: str) -> str:
    """Fill a template for topic x: {n}, {m}, {k} and {audience} are drawn from r, and
    {be}, {does}, {it}, {obj}, {its} agree in number with x."""
    plural = x in PLURAL_TOPICS
    person = PEOPLE_PRONOUNS.get(x)
    extra = {
        "n": r.choice(COUNTS),
        "m": r.choice(SMALL_COUNTS),
        "k": r.choice(["two", "three", "four"]),
        "audience": r.choice(AUDIENCES),
        "be": "are" if plural else "is",
        "does": "do" if plural else "does",
        "it": "they" if plural else "it",
        "obj": person[0] if person else "them" if plural else "it",
        "its": person[1] if person else "their" if plural else "its",
    }
    return template.format(x=x, **extra, **slots)


def _pick(r: random.Random, templates: list[str], k: int) -> list[str]:
    return r.sample(templates, min(k, len(templates)))


def _topic_prompts(r: random.Random) -> Iterable[str]:
    groups: list[tuple[list[str], list[str], int]] = [
        (CONCEPTS, CONCEPT_TEMPLATES, 10),
        (SKILLS, SKILL_TEMPLATES, 9),
        (COUNTRIES_AND_CITIES, COUNTRY_TEMPLATES, 8),
        (NATURAL_PLACES, NATURE_TEMPLATES, 7),
        (EVENTS, EVENT_TEMPLATES, 8),
        (PEOPLE, PEOPLE_TEMPLATES, 7),
        (ANIMALS, ANIMAL_TEMPLATES, 8),
        (DISHES, DISH_TEMPLATES, 7),
        (ISSUES, ISSUE_TEMPLATES, 7),
        (CULTURE, CULTURE_TEMPLATES, 7),
    ]
    for topics, templates, per_topic in groups:
        for topic in topics:
            for template in _pick(r, templates, per_topic):
                yield _fill(template, r, x=topic)
    for topic, lang in TECH:
        templates = TECH_TEMPLATES if lang else TECH_TEMPLATES_NO_LANG
        for template in _pick(r, templates, 6):
            yield _fill(template, r, x=topic, lang=lang)


def _pair_prompts(r: random.Random) -> Iterable[str]:
    for a, b, situation in PAIRS:
        chosen = _pick(r, PAIR_TEMPLATES, 1 if situation else 2)
        if situation:
            chosen += _pick(r, PAIR_SITUATION_TEMPLATES, 1)
        for template in chosen:
            yield template.format(a=a, b=b, c=situation)


def _code_prompts(r: random.Random) -> Iterable[str]:
    for task in PYTHON_TASKS:
        for template in _pick(r, PYTHON_TASK_TEMPLATES, 2):
            yield template.format(t=task)
    for task in JS_TASKS:
        for template in _pick(r, JS_TASK_TEMPLATES, 2):
            yield template.format(t=task)
    for table, task in SQL_TASKS:
        for template in _pick(r, SQL_TASK_TEMPLATES, 2):
            yield template.format(t=task, table=SQL_TABLES[table])
    for task in SHELL_TASKS:
        for template in _pick(r, SHELL_TASK_TEMPLATES, 2):
            yield template.format(t=task)
    for snippets, templates in (
        (BUGGY_SNIPPETS, BUGGY_TEMPLATES),
        (CORRECT_SNIPPETS, CORRECT_TEMPLATES),
    ):
        for lang, code in snippets:
            for template in _pick(r, templates, 2):
                yield template.format(lang=lang, code=code)


def _language_prompts(r: random.Random) -> Iterable[str]:
    for sentence in SENTENCES_TO_TRANSLATE:
        for lang in TRANSLATE_LANGUAGES:
            yield r.choice(TRANSLATE_TEMPLATES).format(s=sentence, lang=lang)
    for message in INFORMAL_MESSAGES:
        for template in _pick(r, FORMAL_TEMPLATES, r.choice([1, 2])):
            yield template.format(s=message)
    for sentence in GRAMMAR_SENTENCES:
        yield r.choice(GRAMMAR_TEMPLATES).format(s=sentence)
    for term in TERMS:
        yield r.choice(TERM_TEMPLATES).format(t=term)
    for passage in PASSAGES:
        for template in _pick(r, PASSAGE_TEMPLATES, 3):
            yield template.format(p=passage)


def _writing_prompts(r: random.Random) -> Iterable[str]:
    for situation in EMAIL_SITUATIONS:
        for template in _pick(r, EMAIL_TEMPLATES, r.choice([1, 2])):
            yield template.format(s=situation)
    for premise in STORY_PREMISES:
        for template in _pick(r, STORY_TEMPLATES, 2):
            yield template.format(p=premise)
    for subject in POEM_SUBJECTS:
        for template in _pick(r, POEM_TEMPLATES, 2):
            yield template.format(s=subject)


def _math_prompts(r: random.Random) -> Iterable[str]:
    for generator in MATH_GENERATORS:
        for _ in range(MATH_PER_GENERATOR):
            yield generator(r) + r.choice(MATH_SUFFIXES)


def normalize(text: str) -> str:
    """The form two prompts are compared in: case-folded, whitespace collapsed."""
    return " ".join(text.split()).casefold()


def split_of(text: str) -> str:
    """The stable split of a prompt: a SHA-256 hash of its UTF-8 text picks ~10% as heldout."""
    digest = hashlib.sha256(text.encode("utf-8")).digest()
    return "heldout" if int.from_bytes(digest[:8], "big") % 100 < HELDOUT_PERCENT else "train"


def read_prompts(path: Path) -> list[str]:
    """The user-message contents of a prompts .jsonl file."""
    contents: list[str] = []
    with path.open(encoding="utf-8") as f:
        for line in f:
            if line.strip():
                messages = json.loads(line)["messages"]
                contents.extend(m["content"] for m in messages if m["role"] == "user")
    return contents


def build(exclude: Iterable[str] = ()) -> list[str]:
    """All prompts, deduplicated, with those in `exclude` left out, in a fixed shuffled order."""
    r = random.Random(SEED)
    excluded = {normalize(p) for p in exclude}
    sources = [
        _topic_prompts(r),
        _pair_prompts(r),
        _code_prompts(r),
        _language_prompts(r),
        _writing_prompts(r),
        _math_prompts(r),
        iter(FREE_FORM),
    ]
    seen: dict[str, str] = {}
    for source in sources:
        for prompt in source:
            words = len(prompt.split())
            if not MIN_WORDS <= words <= MAX_WORDS:
                raise ValueError(f"prompt has {words} words: {prompt!r}")
            key = normalize(prompt)
            if key not in excluded and key not in seen:
                seen[key] = prompt
    prompts = list(seen.values())
    r.shuffle(prompts)
    return prompts


def to_jsonl(prompts: list[str]) -> str:
    lines = [
        json.dumps(
            {"messages": [{"role": "user", "content": p}], "split": split_of(p)},
            ensure_ascii=False,
        )
        for p in prompts
    ]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT, help="the .jsonl to write")
    parser.add_argument(
        "--exclude",
        type=Path,
        default=DEFAULT_EXCLUDE,
        help="a prompts .jsonl whose prompts must not appear in the output",
    )
    args = parser.parse_args(argv)
    prompts = build(read_prompts(args.exclude))
    data = to_jsonl(prompts).encode("utf-8")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_bytes(data)
    heldout = sum(split_of(p) == "heldout" for p in prompts)
    print(
        f"wrote {len(prompts)} prompts ({heldout} heldout, {len(prompts) - heldout} train), "
        f"{len(data)} bytes, to {args.out}",
        file=sys.stderr,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
