"""instructor, unchanged, extracting a nested Pydantic model (its JSON schema has `$defs`) from
the server: in TOOLS mode (a forced function call whose arguments a grammar keeps valid), in
JSON mode (`json_object`, the schema in the system turn; the user turn shows an example answer,
as a 135M model needs) and in JSON_SCHEMA mode (`response_format` with the schema). Each of five
extractions validates, with no retries allowed."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import instructor
import openai
import pytest
from pydantic import BaseModel

pytestmark = [pytest.mark.model, pytest.mark.server]


class Address(BaseModel):
    city: str
    country: str


class Person(BaseModel):
    name: str
    age: int
    address: Address


PEOPLE = [("Alice", 30, "Paris", "France"), ("Bob", 41, "Rome", "Italy"),
          ("Chen", 25, "Beijing", "China"), ("Dana", 52, "Lima", "Peru"),
          ("Emil", 38, "Oslo", "Norway")]


@pytest.mark.parametrize("mode", [instructor.Mode.TOOLS, instructor.Mode.JSON,
                                  instructor.Mode.JSON_SCHEMA], ids=lambda m: m.name)
def test_nested_model_extraction(base_url: str, model_name: str, mode: instructor.Mode) -> None:
    assert "$defs" in str(Person.model_json_schema())
    client = instructor.from_openai(openai.OpenAI(base_url=base_url, api_key="none",
                                                  max_retries=0), mode=mode)
    # An example answer: in JSON mode (any JSON object) a 135M model shown only the schema
    # tends to copy it, or to quote numbers.
    shape = '{"name": "Zoe", "age": 20, "address": {"city": "Bern", "country": "Swiss"}}'

    def extract(person: tuple[str, int, str, str]) -> Person:
        name, age, city, country = person
        text = f"{name} is {age} years old and lives in {city}, {country}."
        return client.chat.completions.create(
            model=model_name, response_model=Person, max_retries=0, temperature=0,
            max_tokens=120, messages=[{"role": "user", "content": f"Extract like {shape}: {text}"}])

    # All five at once: the server decodes them as one batch (CI time), as it would serve
    # five users.
    with ThreadPoolExecutor(len(PEOPLE)) as pool:
        people = list(pool.map(extract, PEOPLE))
    for person in people:
        assert isinstance(person, Person) and isinstance(person.address, Address)
