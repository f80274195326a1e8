"""Fixed public-domain texts and prompts for quality checks (teacher forcing, perplexity)."""

from __future__ import annotations

PASSAGES = [
    "Four score and seven years ago our fathers brought forth on this continent, a new nation, "
    "conceived in Liberty, and dedicated to the proposition that all men are created equal. "
    "Now we are engaged in a great civil war, testing whether that nation, or any nation so "
    "conceived and so dedicated, can long endure. We are met on a great battle-field of that "
    "war. We have come to dedicate a portion of that field, as a final resting place for those "
    "who here gave their lives that that nation might live. It is altogether fitting and "
    "proper that we should do this.",
    "It is a truth universally acknowledged, that a single man in possession of a good "
    "fortune, must be in want of a wife. However little known the feelings or views of such a "
    "man may be on his first entering a neighbourhood, this truth is so well fixed in the "
    "minds of the surrounding families, that he is considered the rightful property of some "
    "one or other of their daughters. My dear Mr. Bennet, said his lady to him one day, have "
    "you heard that Netherfield Park is let at last?",
    "It was the best of times, it was the worst of times, it was the age of wisdom, it was the "
    "age of foolishness, it was the epoch of belief, it was the epoch of incredulity, it was "
    "the season of Light, it was the season of Darkness, it was the spring of hope, it was the "
    "winter of despair, we had everything before us, we had nothing before us, we were all "
    "going direct to Heaven, we were all going direct the other way.",
    "We the People of the United States, in Order to form a more perfect Union, establish "
    "Justice, insure domestic Tranquility, provide for the common defence, promote the general "
    "Welfare, and secure the Blessings of Liberty to ourselves and our Posterity, do ordain "
    "and establish this Constitution for the United States of America. All legislative Powers "
    "herein granted shall be vested in a Congress of the United States, which shall consist "
    "of a Senate and House of Representatives.",
]

QUESTIONS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "List three prime numbers and explain briefly why each is prime.",
    "Explain what a hash table is in two sentences.",
    "What is 17 times 23?",
    "Give me a short tip for sleeping better.",
    "Translate 'good morning' into Spanish and German.",
    "Who wrote Romeo and Juliet?",
]
