"""What the tests share: the fake engine, fault-injecting runners, live servers, model
fixtures' builders, the scheduler simulator and the OpenAI error assertion."""
