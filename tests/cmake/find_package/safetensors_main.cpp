// Consumer of the installed embedhead::safetensors target: writes a table and reads it back.
#include <embedhead/io/checkpoint.hpp>

#include <cstdio>

int main() {
  embedhead::TokenEmbedding<float> table(8, 4);
  const auto names = embedhead::hugging_face_names(embedhead::ModelFamily::gpt2);
  embedhead::save_checkpoint<float>("consumer.safetensors", names, table);
  auto loaded = embedhead::from_pretrained<float>(embedhead::SafetensorsFile::open("consumer.safetensors"), names);
  const bool same = loaded.token_embedding.weight().value() == table.weight().value();
  std::printf("safetensors round trip: %s\n", same ? "ok" : "MISMATCH");
  return same ? 0 : 1;
}
