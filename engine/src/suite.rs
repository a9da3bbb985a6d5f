//! Task prompts for the accuracy suite (issue 4): RULER-style samples from `mosaickv-tasks`
//! wrapped in the model's chat template, sized with the model's own tokenizer.

use crate::{EngineError, Model, Result};
use mosaickv_tasks::{Sample, Task};

/// Generation budget per task (tokens), RULER's 128 cut to what the answers need: a niah
/// answer with one 7-digit number is about 10 tokens (digits are single tokens), four numbers
/// about 40; `vt` names five 5-letter variables; `cwe` lists ten words. Decoding also stops at
/// an end-of-sequence token.
pub fn answer_budget(task: Task) -> usize {
    match task {
        Task::NiahSingle1 | Task::NiahMultikey => 24,
        Task::NiahMultivalue | Task::NiahMultiquery => 48,
        Task::Vt => 32,
        Task::Cwe => 64,
    }
}

/// The prompt as the model sees it: the chat template (default system message) around the task
/// text, then the answer prefix opening the assistant turn.
pub fn prompt_ids(model: &Model, sample: &Sample) -> Result<Vec<u32>> {
    let text = format!(
        "{}{}",
        model.tokenizer().chat.render(&sample.context),
        sample.answer_prefix
    );
    model.encode_raw(&text)
}

/// A sample of `task` whose prompt ([`prompt_ids`]) plus [`answer_budget`] fits `length`
/// tokens, with the largest haystack that fits; deterministic in `(task, length, seed)`.
///
/// The generator's counter tokenizes the whole text inside the template (the template tokens
/// around the user turn are the same whether the answer prefix sits before `<|im_end|>` or
/// after `assistant\n`); the exact prompt is then re-counted and the haystack shrunk while it
/// still overshoots, so the bound holds for the ids returned.
pub fn task_sample(
    model: &Model,
    task: Task,
    length: usize,
    seed: u64,
) -> Result<(Sample, Vec<u32>)> {
    let budget = answer_budget(task);
    let count = |s: &str| -> usize {
        model
            .encode_raw(&model.tokenizer().chat.render(s))
            .map(|v| v.len())
            .unwrap_or(usize::MAX)
    };
    let mut size = mosaickv_tasks::haystack_size_for(task, length, budget, seed, &count)
        .map_err(|e| EngineError::Invalid(e.to_string()))?;
    loop {
        let sample = mosaickv_tasks::render(task, size, seed, length);
        let ids = prompt_ids(model, &sample)?;
        if ids.len() + budget <= length {
            return Ok((sample, ids));
        }
        if size == 0 {
            return Err(EngineError::Invalid(format!(
                "task {task}: {} prompt tokens + {budget} answer tokens exceed the length {length}",
                ids.len()
            )));
        }
        size -= 1;
    }
}
